"""Every package the GPU path imports is on the GPU machine: in its image
(scripts/gpu_image_packages.txt) or among the carried wheels (scripts/gpu_wheels.txt), unless
only a feature the GPU check never asks for imports it (scripts/gpu_not_carried.txt), and then
the GPU path runs with it hidden. The carried wheels are exactly what is needed beyond the
image, pinned at or above pyproject's floors.

The GPU path: scripts/gpu_check.py, and the processes it starts (`python -m pagedserve.cli
memsvc|executor|gateway|bench serve|bench split`). Its imports are read from the source (every
`import` and `from` statement, in functions too, and pagedserve.wire.optional_import.require calls),
following pagedserve's own modules; each third-party module is named by the installed
distribution that holds its file. No network, no GPU."""
from __future__ import annotations

import ast
import importlib.util
import sys
from collections import defaultdict
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_packages  # noqa: E402

FIRST_PARTY = {"wire", "kernels", "memsvc", "executor", "gateway", "pagedserve", "benchmarks"}
ENTRIES = ["scripts/gpu_check.py", "pagedserve.cli", "pagedserve.service_cmds", "pagedserve.memsvc.server",
           "pagedserve.executor.server", "pagedserve.gateway.main", "pagedserve.benchmarks.serve", "pagedserve.benchmarks.split"]
TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def source_of(module: str) -> Path | None:
    if module.endswith(".py"):
        return REPO / module
    top = module.split(".")[0]
    if top not in FIRST_PARTY and not (REPO / "scripts" / f"{top}.py").exists():
        return None
    base = REPO / Path(*module.split(".")) if top in FIRST_PARTY else REPO / "scripts" / Path(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.exists():
            return path
    return None


def parse(source: str) -> ast.Module:
    """ast.parse, once more where CPython 3.11's AST constructor raised its spurious
    "recursion depth mismatch" (its depth count is shared with any other thread building an
    AST meanwhile: python/cpython#106905)."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def imported_names(path: Path, module: str):
    """Every module name an import statement (or a `require("module", ...)` call) in `path` names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module
            yield name
            yield from (f"{name}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "require"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value


@lru_cache(maxsize=1)
def gpu_path() -> tuple[dict[str, set[str]], set[str]]:
    """(third-party module -> the first-party modules importing it, first-party modules reached)."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    third, seen, todo = defaultdict(set), set(), list(ENTRIES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = source_of(module)
        if path is None:
            continue
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)) if not module.endswith(".py"))
        for name in imported_names(path, module.removesuffix(".py").replace("/", ".")):
            top = name.split(".")[0]
            if top in stdlib:
                continue
            if source_of(name) is not None:
                todo.append(name)
            elif top not in FIRST_PARTY and not (REPO / "scripts" / f"{top}.py").exists():
                third[name].add(module)
    return third, seen


@lru_cache(maxsize=1)
def module_owners() -> dict[str, str]:
    """Dotted module name -> the installed distribution holding its file."""
    owners = {}
    for dist in metadata.distributions():
        name = gpu_packages.normalize(dist.metadata["Name"])
        for f in dist.files or ():
            text = str(f)
            if not text.endswith((".py", ".so")) or text.startswith(("..", "/")):
                continue
            stem = text[: -len(".py")] if text.endswith(".py") else text.split(".")[0]
            dotted = stem.replace("/", ".").removesuffix(".__init__")
            owners.setdefault(dotted, name)
    return owners


def distribution_of(module: str) -> str | None:
    owners, parts = module_owners(), module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in owners:
            return owners[".".join(parts[:i])]
    return None


@lru_cache(maxsize=1)
def reached() -> dict[str, set[str]]:
    """distribution -> the modules of the GPU path importing it. A module no distribution
    installed here provides (matplotlib: no dependency of pagedserve's) is named by its
    top-level name; a namespace package (`opentelemetry` of `from opentelemetry import
    trace`) by the modules imported from it."""
    third, _ = gpu_path()
    out = defaultdict(set)
    for module, importers in third.items():
        dist = distribution_of(module)
        if dist is None:
            if any(other.startswith(module + ".") and distribution_of(other) for other in third):
                continue
            dist = gpu_packages.normalize(module.split(".")[0])
        out[dist] |= importers
    return out


def requirements(dist: str) -> set[str]:
    from packaging.requirements import Requirement

    out = set()
    for text in metadata.requires(dist) or ():
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(TARGET):
            out.add(gpu_packages.normalize(req.name))
    return out


def test_the_walk_reaches_the_services_and_the_check():
    _, seen = gpu_path()
    assert {"pagedserve.memsvc.server", "pagedserve.executor.server", "pagedserve.gateway.server", "pagedserve.gateway.main", "pagedserve.kernels.paged_attention_triton",
            "pagedserve.executor.model_runner", "pagedserve.client", "gpu_packages"} <= seen
    assert {"torch", "grpcio", "protobuf", "transformers", "triton"} <= set(reached())


def test_every_import_of_the_gpu_path_is_on_the_gpu_machine():
    known = set(gpu_packages.image_packages()) | set(gpu_packages.carried_wheels()) | set(gpu_packages.not_carried())
    missing = {dist: sorted(importers)[:4] for dist, importers in reached().items() if dist not in known}
    assert not missing, ("imported on the GPU path but in none of scripts/gpu_image_packages.txt, gpu_wheels.txt, "
                         f"gpu_not_carried.txt: {missing}")


def test_the_carried_wheels_are_exactly_what_the_image_lacks():
    image, not_carried = gpu_packages.image_packages(), set(gpu_packages.not_carried())
    needed = {dist for dist in reached() if dist not in image and dist not in not_carried}
    # and those the stubs check the version of at import, where the image's is not known
    needed |= {dist for dist in gpu_packages.IMPORTED if image[dist][0] == "?"}
    todo = list(needed)
    while todo:  # and what those require, where the image does not have it
        for dep in requirements(todo.pop()):
            if dep not in image and dep not in needed:
                needed.add(dep)
                todo.append(dep)
    assert set(gpu_packages.carried_wheels()) == needed


def test_each_not_carried_package_is_imported_somewhere_on_the_path():
    """A line of gpu_not_carried.txt nothing imports any more is stale."""
    stale = set(gpu_packages.not_carried()) - set(reached())
    assert not stale, f"scripts/gpu_not_carried.txt names packages the GPU path never imports: {sorted(stale)}"
    assert not set(gpu_packages.not_carried()) & set(gpu_packages.carried_wheels())


def test_pins_meet_the_floors_and_are_what_is_tested_here():
    floors = gpu_packages.floors()
    for dist, version in gpu_packages.carried_wheels().items():
        if dist in floors:
            assert gpu_packages.version_tuple(version) >= gpu_packages.version_tuple(floors[dist]), dist
    assert floors["grpcio"] == "1.85.1" and floors["protobuf"] == "7.35.1"


def hidden_modules() -> list[str]:
    """The module prefixes that only the not-carried distributions hold (opentelemetry.sdk,
    not opentelemetry, which the API shares), as installed here; a distribution not installed
    here by its name."""
    holders = defaultdict(set)  # dotted prefix -> the distributions with a module under it
    for module, dist in module_owners().items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            holders[".".join(parts[:i])].add(dist)
    prefixes = set()
    for dist in gpu_packages.not_carried():
        mine = [m for m, d in module_owners().items() if d == dist]
        for module in mine:
            parts = module.split(".")
            prefixes.add(next(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                              if holders[".".join(parts[:i])] == {dist}))
        if not mine:
            prefixes.add(dist.replace("-", "_"))
    return sorted(p for p in prefixes if not any(p.startswith(q + ".") for q in prefixes))


@pytest.mark.parametrize("dist", ["grpcio", "protobuf"])
def test_to_install_takes_a_carried_package_below_its_floor(monkeypatch, dist):
    versions = {"grpcio": "1.71.0", "protobuf": "5.29.5"}
    monkeypatch.setattr(gpu_packages, "installed_version", lambda name: versions.get(name, "99.0"))
    assert gpu_packages.to_install() == ["grpcio", "protobuf"]
    versions[dist] = None
    assert dist in gpu_packages.to_install()
    monkeypatch.setattr(gpu_packages, "installed_version", lambda name: "99.0")
    assert gpu_packages.to_install() == []
    assert importlib.util.find_spec("tomllib") is not None  # gpu_packages reads pyproject with it
