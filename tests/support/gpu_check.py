"""scripts/gpu_check.py loaded as a module, for the tests that check it without a GPU."""
import importlib.util

from tests.support import REPO

SCRIPTS = REPO / "scripts"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
