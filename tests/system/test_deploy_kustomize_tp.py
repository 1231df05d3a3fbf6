"""The tensor-parallel overlays (tests/unit/deploy/test_deploy_tensor_parallel.py) render with
`kubectl kustomize` exactly as the tests' loader renders them (issue 29)."""
import shutil

import pytest

from tests.system.test_deploy_kustomize import test_loader_renders_what_kustomize_renders as same_render
from tests.unit.deploy.test_deploy_tensor_parallel import OVERLAYS


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_loader_renders_what_kustomize_renders_tp(overlay):
    same_render(overlay)
