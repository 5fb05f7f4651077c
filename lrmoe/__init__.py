"""lrmoe: demand-side load recalibration for expert-parallel MoE training, with the SYMI baseline."""
__version__ = "0.1.0"
