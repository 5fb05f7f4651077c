"""lrmoe: demand-side load recalibration for expert-parallel MoE training, with the SYMI baseline.

kernels/, experiments/ and paper_figures/ sit at the repository's top level and import as lrmoe.kernels,
lrmoe.experiments and lrmoe.paper_figures: installed through pyproject's package-dir, and in a plain checkout through
the links of the same names in this folder.
"""

__version__ = "0.1.0"
