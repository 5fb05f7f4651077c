"""Analysis of results files: runs, seeds and the statistics that decide a claim (above the runtime and the
simulator, beside the harness; scripts and notebooks read results through it).

* :mod:`~lrmoe.analysis.runs`: convergence runs read back: per run, per system over seeds, and the equal-quality
  table (step and modelled time to reach the reference's loss).
* :mod:`~lrmoe.analysis.frontier`: the retention budget's frontier: modelled paper-scale times joined with the runs'
  loss, the headline rule, and a regime's time axis at the Zipf s matched to its runs.
"""
