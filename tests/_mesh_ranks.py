"""One torchrun rank of the mesh tests (tests/test_mesh.py starts two torchrun "nodes" of 2 ranks on loopback).

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 ... tests/_mesh_ranks.py MODE OUT [SYSTEM ...]

``train``: the systems (default: all of ``_mesh_training.MATCHED``) trained on the default mesh (EP = the ranks
of a node, torchrun's LOCAL_WORLD_SIZE) against the dense reference; each rank writes ``OUT/rank<r>.json``.
``kill`` / ``raise``: global rank 3 dies by SIGKILL / raises in the middle of its second step (after its forward,
before its backward), having written ``OUT/failed_at`` (the time); every rank writes ``OUT/pid<r>`` first.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import _mesh_training as mt  # noqa: E402

from lrmoe.runtime.distributed.comm import init_process_group_from_env  # noqa: E402
from lrmoe.runtime.distributed.mesh import build_mesh  # noqa: E402
from lrmoe.runtime.distributed.torchrun import record  # noqa: E402


class FailOnPurpose(RuntimeError):
    pass


@record
def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    info = init_process_group_from_env(timeout_s=120)
    (out / f"pid{info.rank}").write_text(str(os.getpid()))
    mesh = build_mesh()
    if mode == "train":
        results = {name: mt.train(name, mesh) for name in (sys.argv[3:] or mt.MATCHED)}
        (out / f"rank{info.rank}.json").write_text(json.dumps(results))
        return
    layer = mt.make_layer("symi-dropless", mesh, mt.skewed_reference())
    x, w = mt.batch(info.world_size, 0)
    mine = slice(info.rank * mt.T, (info.rank + 1) * mt.T)
    for step in range(1000):
        y, _ = layer(x[mine].clone())
        if step == 1 and info.rank == 3:
            (out / "failed_at").write_text(repr(time.time()))
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise FailOnPurpose("rank 3 fails in the middle of its second step")
        (y * w[mine]).sum().backward()
        layer.sync_dense_grads()
        layer.expert_step()


if __name__ == "__main__":
    main()
