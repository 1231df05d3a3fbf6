"""Imports point one way: wire < kernels < the services < pagedserve < benchmarks < cli.

Every import in every module counts, those inside functions too: a lazy import is still a
dependency. The services (memsvc, executor, gateway) never import each other.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO as ROOT

LAYER = {"wire": 0, "kernels": 1, "memsvc": 2, "executor": 2, "gateway": 2, "pagedserve": 3,
         "benchmarks": 4}
SERVICES = {"memsvc", "executor", "gateway"}
TOP = "pagedserve.cli"  # registers the benchmarks' subcommands: the one module above them


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a project package in the file at `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.split(".")[0] in LAYER]
    return out


def modules():
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


def violations(package: str, path: Path) -> list[str]:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    bad = []
    for line, name in project_imports(path):
        target = name.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line} imports {name}"
        if package in SERVICES and target in SERVICES and target != package:
            bad.append(f"{where}: a service imports another service")
        elif (name == TOP or name.startswith(TOP + ".")) and module != TOP:
            bad.append(f"{where}: only the command line sits above the benchmarks")
        elif LAYER[target] > LAYER[package] and module != TOP:
            bad.append(f"{where}: {package} (layer {LAYER[package]}) may not import "
                       f"{target} (layer {LAYER[target]})")
    return bad


def test_every_import_points_down():
    bad = [v for package, path in modules() for v in violations(package, path)]
    assert not bad, "imports against the layering (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


@pytest.mark.parametrize("package,source,expected", [
    ("memsvc", "from executor.config import ExecutorConfig\n", "another service"),
    ("gateway", "def f():\n    import memsvc.block_pool\n", "another service"),
    ("wire", "from gateway.scheduler import Scheduler\n", "may not import"),
    ("executor", "from pagedserve.engine import LLMEngine\n", "may not import"),
    ("pagedserve", "from benchmarks.kv import simulate\n", "may not import"),
])
def test_the_check_catches_an_upward_import(tmp_path, package, source, expected):
    path = ROOT / package / "_layers_probe.py"
    try:
        path.write_text(source)
        found = violations(package, path)
    finally:
        path.unlink()
    assert found and expected in found[0]


def test_the_check_allows_downward_imports():
    probe = ROOT / "pagedserve" / "_layers_probe.py"
    try:
        probe.write_text("import wire.protocol\nfrom kernels import paged_attention\n"
                         "from memsvc.config import MemsvcConfig\nfrom gateway.config import GatewayConfig\n")
        assert violations("pagedserve", probe) == []
    finally:
        probe.unlink()
