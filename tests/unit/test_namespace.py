"""One namespace: the distribution installs the top-level package `pagedserve` and nothing
else beside it (a top-level `kernels` or `wire` would meet PyPI's packages of that name:
Hugging Face's `kernels` came with transformers 5.25). Read from pyproject.toml as
setuptools reads it; every package under pagedserve/ is listed, so none is left out of a
wheel."""
from __future__ import annotations

from pathlib import Path

from setuptools import find_packages
from setuptools.config.pyprojecttoml import read_configuration

from tests.support import REPO


def installed_packages(pyproject: Path) -> list[str]:
    """The packages and top-level modules a build of `pyproject` installs."""
    tool = read_configuration(pyproject)["tool"]["setuptools"]
    packages = tool.get("packages")
    if isinstance(packages, dict):  # packages.find
        found = packages.get("find", {})
        where = found.get("where", ["."])
        packages = [p for w in where for p in find_packages(pyproject.parent / w, include=found.get("include", ("*",)),
                                                             exclude=found.get("exclude", ()))]
    return list(packages or []) + list(tool.get("py-modules") or [])


def top_level(pyproject: Path) -> set[str]:
    return {name.split(".")[0] for name in installed_packages(pyproject)}


def test_the_distribution_installs_pagedserve_alone():
    assert top_level(REPO / "pyproject.toml") == {"pagedserve"}


def test_every_package_under_pagedserve_is_installed():
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "pagedserve").rglob("__init__.py")}
    missing = folders - set(installed_packages(REPO / "pyproject.toml"))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_a_second_top_level_package_is_caught(tmp_path):
    text = (REPO / "pyproject.toml").read_text()
    planted = tmp_path / "pyproject.toml"
    planted.write_text(text.replace('packages = ["pagedserve"', 'packages = ["kernels", "pagedserve"', 1))
    assert top_level(planted) == {"kernels", "pagedserve"}
