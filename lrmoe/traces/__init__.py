"""Routing traces below the simulator (DESIGN.md §7): the trace type and its file format
(:mod:`~lrmoe.traces.trace`, NumPy only), skew statistics (:mod:`~lrmoe.traces.stats`) and the synthetic generator
(:mod:`~lrmoe.traces.synthetic`). Recording from real routers and importing Megatron-Core traces, which need the
model or the runtime, live in :mod:`lrmoe.integrations.traces`. Nothing is imported here, so that loading a trace
file imports neither torch nor the runtime.
"""
