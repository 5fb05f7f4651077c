"""The emulated expert-parallel engine: N ranks as turn-taking threads of one process, every exchange a local gather.

* :mod:`~lrmoe.runtime.inprocess.group`: the in-process ``torch.distributed`` backend (the baton the ranks pass, the
  rounds of each collective, the point-to-point mailboxes);
* :mod:`~lrmoe.runtime.inprocess.launch`: :func:`launch_inprocess`, the fork launcher's contract on threads.

The ranks run the distributed runtime's own code (the layer, the dispatcher, the replica substrate, the planner,
the metric and the optimizers) through ``torch.distributed``'s own functions; only the process group differs.
"""

from lrmoe.runtime.inprocess.group import BACKEND, PeerFailed
from lrmoe.runtime.inprocess.launch import launch_inprocess

__all__ = ["BACKEND", "PeerFailed", "launch_inprocess"]
