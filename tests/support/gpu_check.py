"""scripts/gpu_check.py loaded as a module, and its part modules beside it (gpu_check_services,
gpu_check_kernels, ...), for the tests that check them without a GPU."""
import importlib
import importlib.util
import sys

from tests.support import REPO

SCRIPTS = REPO / "scripts"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_part(name: str):
    """A module of scripts/ beside gpu_check.py (e.g. "gpu_check_services"), imported with
    scripts/ on sys.path as gpu_check.py's runners() imports it."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)
