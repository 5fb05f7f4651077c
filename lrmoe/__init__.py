"""lrmoe: demand-side load recalibration for expert-parallel MoE training, with the SYMI baseline."""

from importlib.util import find_spec as _find_spec
from pathlib import Path as _Path

__version__ = "0.1.0"

# kernels/ sits at the repository's top level and is installed as lrmoe.kernels (pyproject package-dir). From a
# plain checkout that was never installed (e.g. PYTHONPATH=. on a machine without a package registry), make the
# same import work by looking for subpackages beside this folder too.
if _find_spec(__name__ + ".kernels") is None and (_Path(__file__).resolve().parent.parent / "kernels").is_dir():
    __path__.append(str(_Path(__file__).resolve().parent.parent))
