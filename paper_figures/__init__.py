"""Figures from results files, importable as lrmoe.paper_figures (python paper_figures/make_all.py draws them all)."""
