"""The recalibration metric: which token-expert pairs the backward keeps (DESIGN.md §4 steps 4–5).

* :mod:`~lrmoe.recal.scoring`: metrics as objects (m1, m2, m3, gate, random) and their registry;
* :mod:`~lrmoe.recal.selection`: top-quota or unbiased (Horvitz–Thompson) selection per quota group;
* :mod:`~lrmoe.recal.backward_config`: a system's recalibration settings (metric, mode, compaction);
* :mod:`~lrmoe.recal.recalibrate`: the same selection as a backward hook on a single-process MoE.

Pure: device tensors in, a keep mask and scales out.

Shape letters (DESIGN.md §8 has the full glossary): P pairs of one rank's tokens (P = T·K), Q quota groups,
C columns of a small per-row table (a metric's extra combine columns), T tokens, K top-k, D hidden width.
"""
