"""Imports point one way, by the second component of the module name: pagedserve.wire (the
contract) < pagedserve.rpc, pagedserve.pool_share < pagedserve.kernels, pagedserve.step < the services
(memsvc, executor, gateway) < the entry points (the modules in pagedserve/ itself) <
pagedserve.benchmarks < pagedserve.cli (docs/ARCHITECTURE.md).

Every import in every module counts, those inside functions too: a lazy import is still a
dependency. The services never import each other; neither do rpc and pool_share.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO as ROOT

PACKAGE = ROOT / "pagedserve"
ENTRY = "entry points"  # pagedserve/*.py
LAYER = {"wire": 0, "rpc": 1, "pool_share": 1, "kernels": 2, "step": 2, "memsvc": 3, "executor": 3, "gateway": 3,
         ENTRY: 4, "benchmarks": 5}
PEERS = [{"memsvc", "executor", "gateway"}, {"rpc", "pool_share"}]  # side by side, never importing each other
TOP = "pagedserve.cli"  # registers the benchmarks' subcommands: the one module above them


def layer_of(module: str) -> str | None:
    """The layer a project module sits in: its subpackage (pagedserve.X...) or ENTRY."""
    parts = module.split(".")
    if parts[0] != "pagedserve":
        return None
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return ENTRY


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the project in the file at `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            names += [node.module] if node.module != "pagedserve" else []
        else:
            continue
        out += [(node.lineno, n) for n in names if layer_of(n) is not None]
    return out


def modules():
    yield from sorted(PACKAGE.rglob("*.py"))


def violations(path: Path) -> list[str]:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    here = layer_of(module)
    if here not in LAYER:
        return [f"{path.relative_to(ROOT)}: pagedserve/{module.split('.')[1]}/ has no layer in LAYER"]
    bad = []
    for line, name in project_imports(path):
        target = layer_of(name)
        where = f"{path.relative_to(ROOT)}:{line} imports {name}"
        if target not in LAYER:
            bad.append(f"{where}: pagedserve.{name.split('.')[1]} has no layer in LAYER")
        elif any(here in peers and target in peers and target != here for peers in PEERS):
            bad.append(f"{where}: {here} and {target} sit side by side and never import each other")
        elif (name == TOP or name.startswith(TOP + ".")) and module != TOP:
            bad.append(f"{where}: only the command line sits above the benchmarks")
        elif LAYER[target] > LAYER[here] and module != TOP:
            bad.append(f"{where}: {here} (layer {LAYER[here]}) may not import {target} (layer {LAYER[target]})")
    return bad


def test_every_import_points_down():
    bad = [v for path in modules() for v in violations(path)]
    assert not bad, "imports against the layering (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_every_subpackage_has_a_layer():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == set(LAYER) - {ENTRY}, "add the new subpackage to LAYER (and docs/ARCHITECTURE.md)"


@pytest.mark.parametrize("package,source,expected", [
    ("memsvc", "from pagedserve.executor.config import ExecutorConfig\n", "side by side"),
    ("gateway", "def f():\n    import pagedserve.memsvc.block_pool\n", "side by side"),
    ("rpc", "from pagedserve.pool_share import shm_pool\n", "side by side"),
    ("wire", "from pagedserve.gateway.scheduler import Scheduler\n", "may not import"),
    ("wire", "from pagedserve.rpc import tls\n", "may not import"),
    ("pool_share", "from pagedserve.kernels import paged_attention\n", "may not import"),
    ("executor", "from pagedserve.engine import LLMEngine\n", "may not import"),
    ("executor", "from pagedserve import engine\n", "may not import"),
    (None, "from pagedserve.benchmarks.kv import simulate\n", "may not import"),
])
def test_the_check_catches_an_upward_import(package, source, expected):
    path = (PACKAGE / package if package else PACKAGE) / "_layers_probe.py"
    try:
        path.write_text(source)
        found = violations(path)
    finally:
        path.unlink()
    assert found and expected in found[0]


def test_the_check_allows_downward_imports():
    probe = PACKAGE / "_layers_probe.py"
    try:
        probe.write_text("import pagedserve.wire.protocol\nfrom pagedserve.kernels import paged_attention\n"
                         "from pagedserve.rpc import tls\nfrom pagedserve.pool_share import shm_pool\n"
                         "from pagedserve.memsvc.config import MemsvcConfig\n"
                         "from pagedserve.gateway.config import GatewayConfig\nfrom pagedserve import engine\n")
        assert violations(probe) == []
    finally:
        probe.unlink()
