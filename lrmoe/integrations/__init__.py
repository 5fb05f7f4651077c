"""What connects the layer to real training: the Hugging Face drop-in, the small transformer, text data, routing
traces, load statistics, and results files with W&B tracking.

* :mod:`~lrmoe.integrations.hf`: Qwen3-MoE and GLM-4.5 blocks of ``transformers`` on the expert-parallel layer;
* :mod:`~lrmoe.integrations.model`: the small MoE transformer of the training runs;
* :mod:`~lrmoe.integrations.data`: the text corpus and its batches;
* :mod:`~lrmoe.integrations.traces`: routing traces recorded from Hugging Face routers or imported from Megatron-Core
  (the trace type, its file and the generator are :mod:`lrmoe.traces`);
* :mod:`~lrmoe.integrations.load_stats`: per-rank load statistics of a plan, for logs;
* :mod:`~lrmoe.integrations.tracking`: the Tracker (resumable results files, W&B runs); the files themselves (atomic
  writes, locks, readers, manifests) are :mod:`lrmoe.results`;
* :mod:`~lrmoe.integrations.tracking_args`: the output flags every script shares and their checks;
* :mod:`~lrmoe.integrations.provenance`, :mod:`~lrmoe.integrations.wandb_policy`,
  :mod:`~lrmoe.integrations.reports`: a run's header (commit, versions, device), W&B's mode and names, and a
  results file's Markdown report;
* :mod:`~lrmoe.integrations.checkpoint`: a run's checkpoint folder (owner, lock, manifests, records, pruning);
* :mod:`~lrmoe.integrations.checkpoint_state`: one training state as a sharded DCP checkpoint, re-sharded on load.

Shape letters (DESIGN.md §8 has the full glossary): I iterations, L layers, T tokens, K top-k, E experts, N ranks.
"""
