"""Measurement harness: timing helpers and the CPU calibration micro-benchmarks (kept apart from the simulator)."""
