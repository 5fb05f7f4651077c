"""Measurement harness (kept apart from the simulator): what the scripts that measure share.

* :mod:`~lrmoe.harness.timing`: wall-clock and CPU-clock timing helpers;
* :mod:`~lrmoe.harness.calibrate_cpu`: the CPU calibration micro-benchmarks (GEMM curve, all-to-all, Adam);
* :mod:`~lrmoe.harness.replica_sync_timing`: the replica-sync timing;
* :mod:`~lrmoe.harness.layer_bench_setup`: the layer benchmark's policies, memory budget and traces (the benchmark
  and the simulator's validation replay the same plans);
* :mod:`~lrmoe.harness.layer_bench_rank`: one rank of the layer benchmark (every trace and policy on the real layer,
  one record per measured step); :mod:`~lrmoe.harness.layer_bench_summary`: its per-phase, per-policy and target
  tables;
* :mod:`~lrmoe.harness.gradient_error`: the layer's gradient error against the full gradient (every routed pair kept),
  over all ranks' shards;
* :mod:`~lrmoe.harness.sim_validation_run`: the simulator's validation run (calibration file, per-phase comparison,
  the frontier protocol's measured points), its logged tables and reports;
* :mod:`~lrmoe.harness.job_stages`: the main job's stages (what each writes, its identity, its summary tables);
  :mod:`~lrmoe.harness.job_schedule`: their processes and scheduling;
* :mod:`~lrmoe.harness.kernel_bench`: the kernel benchmark's measurements and correctness checks (compaction, grouped
  GEMM); :mod:`~lrmoe.harness.kernel_bench_run`: its run over the CPU and GPU parts, its summary and tables;
* :mod:`~lrmoe.harness.planner_bench`: the planner benchmark's measurements per policy, E and N (old plan, placement,
  critical path, the previous implementation), its summary and tables;
* :mod:`~lrmoe.harness.import_graph`: the package's import graph against its contracts (``make import-graph``).
"""
