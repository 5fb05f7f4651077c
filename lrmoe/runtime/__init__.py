"""The runtime: the expert-parallel layer on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

* :mod:`~lrmoe.runtime.layer`: :class:`~lrmoe.runtime.layer.EPMoELayer`: routing, planning once per iteration,
  the shared expert, orchestration;
* :mod:`~lrmoe.runtime.dispatch`: the token dispatcher, the one forward data path;
* :mod:`~lrmoe.runtime.comm`: the communication object every exchange of the layer goes through (rank, group,
  accountant);
* :mod:`~lrmoe.runtime.exchange`: the recalibrated expert exchange, one autograd op;
* :mod:`~lrmoe.runtime.expert_compute`: the SwiGLU experts on grouped GEMMs, forward and backward by hand;
* :mod:`~lrmoe.runtime.routing`: the routers (softmax top-k, GLM's sigmoid with bias);
* :mod:`~lrmoe.runtime.clip`: gradient clipping by the global norm over the dense parameters and the experts;
* :mod:`~lrmoe.runtime.optim`: the step core, one ``torch.optim.Optimizer`` over the dense parameters and the
  experts (dense sync, clip, dense step, expert step, GLM's bias update);
* :mod:`~lrmoe.runtime.dense_sync`: the dense gradients' all-reduce with the non-finite check, and the check
  that every rank starts from the same weights;
* :mod:`~lrmoe.runtime.reference`: the dense single-process reference every test compares against;
* :mod:`~lrmoe.runtime.distributed`: all-to-all and point-to-point, the launcher, the replica substrate, the
  accountant;
* :mod:`~lrmoe.runtime.inprocess`: the emulated engine: the ranks as turn-taking threads of one process, on an
  in-process ``torch.distributed`` backend that gives gloo's results bit for bit (the same code runs on it).

Shape letters (DESIGN.md §8 has the full glossary): T tokens of a rank, K top-k, P = T·K pairs, D hidden width,
F expert FFN width, E experts, N ranks, S slots per rank, G = N·S global slots, M pair rows at home in packed order,
R rows on the expert side, W = 3·D·F parameters of one expert.
"""
