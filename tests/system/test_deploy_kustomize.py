"""The manifests' loader (tests/unit/deploy/test_deploy_manifests.py) renders each overlay
as `kubectl kustomize` does."""
import shutil
import subprocess

import pytest
import yaml

from tests.unit.deploy.test_deploy_manifests import KUBE, OVERLAYS, canonical, kustomize


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_loader_renders_what_kustomize_renders(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    ours = kustomize(KUBE / "overlays" / overlay)
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, ours)) == sorted(map(key, theirs))
    for a, b in zip(sorted(ours, key=key), sorted(theirs, key=key)):
        assert canonical(a) == canonical(b), key(a)
