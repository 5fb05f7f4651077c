"""Analysis of results files: runs, seeds and the statistics that decide a claim (above the runtime and the
simulator, beside the harness; scripts and notebooks read results through it).

* :mod:`~lrmoe.analysis.runs`: convergence runs read back: per run, per system over seeds, and the equal-quality
  table (step and modelled time to reach the reference's loss).
* :mod:`~lrmoe.analysis.frontier`: the retention budget's frontier: modelled paper-scale times joined with the runs'
  loss, the headline rule, and a regime's time axis at the Zipf s matched to its runs.
* :mod:`~lrmoe.analysis.fidelity`: the gradient fidelity of backward recalibration (recalibrated against full
  gradients of one MoE layer, and every metric against random); :mod:`~lrmoe.analysis.fidelity_sources`: its data
  sources (random-init layers on random data, trained layers on text with their real inputs and gradients).
* :mod:`~lrmoe.analysis.ablation_report`: the ablation's tables (every run, the headline with its band, the
  assumptions); :mod:`~lrmoe.analysis.memory_sweep_report`: the memory-pressure sweep's report.
"""
