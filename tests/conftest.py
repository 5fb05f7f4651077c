"""Test harness: environment first (before any kernel module is imported), then shared fixtures.

* ``TRITON_INTERPRET=1`` when no GPU is present, so Triton kernels run in the interpreter;
* W&B offline, and W&B / Jupyter / matplotlib files kept in a temporary folder, not in ``$HOME``;
* a non-interactive matplotlib backend;
* one intra-op torch thread (bitwise determinism, see below), in the processes the tests start too
  (``OMP_NUM_THREADS``: notebook kernels, scripts, the main job; two test workers share two cores).
"""

import os
import sys
import tempfile

_SANDBOX = tempfile.mkdtemp(prefix="lrmoe-tests-")


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


if not _gpu_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["MPLBACKEND"] = "Agg"
os.environ.setdefault("OMP_NUM_THREADS", "1")
for _var, _sub in [("WANDB_DIR", "wandb"), ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_CONFIG_DIR", "wandb-config"),
                   ("WANDB_DATA_DIR", "wandb-data"), ("MPLCONFIGDIR", "matplotlib"), ("JUPYTER_CONFIG_DIR", "jupyter"),
                   ("JUPYTER_DATA_DIR", "jupyter-data"), ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"),
                   ("IPYTHONDIR", "ipython")]:
    os.environ[_var] = os.path.join(_SANDBOX, _sub)
    os.makedirs(os.environ[_var], exist_ok=True)

import pytest  # noqa: E402  (after the environment above)
import torch  # noqa: E402

# Bitwise run-to-run determinism on CPU needs one intra-op thread: with two, the BLAS splits the layers' small
# per-expert GEMMs between threads differently from run to run (last-bit differences). The launcher's ranks and
# the experiments run one thread per process for the same reason.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same global seed."""
    torch.manual_seed(0)
    yield
    # and leaves no figure open for the next one (a test that draws does not always close what it drew; matplotlib
    # is imported only where a test drew)
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")


@pytest.fixture
def sandbox(tmp_path):
    """A temporary folder for a test's output files."""
    return tmp_path
