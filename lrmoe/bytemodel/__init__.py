"""The byte and memory models: what a plan sends, what the optimizer step exchanges, what a rank must hold.

* :mod:`~lrmoe.bytemodel.layout`: the bytes of every packet of a plan, and the one phase vocabulary;
* :mod:`~lrmoe.bytemodel.sync_model`: the bytes and rows of the replica-gradient sum, the sharded Adam and the
  redistribution (and of online replication's weight push);
* :mod:`~lrmoe.bytemodel.memory`: the one memory model (slots, saved activations, exchange buffers), term by term.

Pure: plain torch on plans, no processes. The runtime's accountant and the simulator read the same functions.

Shape letters (DESIGN.md §8 has the full glossary): N ranks, S slots per rank, G = N·S global slots, E experts,
D hidden width, F expert FFN width, H phases, V backward flows, W = 3·D·F parameters of one expert.
"""
