"""Analysis of results files: runs, seeds and the statistics that decide a claim (above the runtime and the
simulator, beside the harness; scripts and notebooks read results through it).

* :mod:`~lrmoe.analysis.runs`: convergence runs read back: per run, per system over seeds, and the equal-quality
  table (step and modelled time to reach the reference's loss).
"""
