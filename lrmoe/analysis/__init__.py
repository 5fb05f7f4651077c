"""Analysis of results files: runs, seeds and the statistics that decide a claim (above the runtime and the
simulator, beside the harness; scripts and notebooks read results through it)."""
