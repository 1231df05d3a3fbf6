"""The packages of the GPU path, read from the lists that say them; standard library only, since
it runs on the GPU machine before anything is installed (scripts/gpu_check.sh).

- scripts/gpu_image_packages.txt: what the GPU machine's image has (its version where known)
  and what `gpu_check.sh --rehearse` installs in its place here;
- scripts/gpu_wheels.txt: the distributions that travel as wheels (scripts/gpu_wheels/, made by
  scripts/gpu_wheels.sh), pinned, one version each;
- scripts/gpu_not_carried.txt: distributions the code imports only for features the GPU check
  never asks for (each with its feature), so no wheel travels for them;
- pyproject.toml: the floors (`name>=version`) of pagedserve's dependencies.

`to_install()` is what gpu_check.sh installs from the wheels: each carried distribution that is
missing, or installed below pyproject's floor (the image's grpcio and protobuf versions are not
known; the committed stubs need recent ones). `problems()` names an imported grpcio or protobuf
still below its floor (a wheel that did not install, or one that another copy shadows).
"""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
IMPORTED = {"grpcio": "grpc", "protobuf": "google.protobuf"}  # checked as imported, by problems()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _rows(path: Path) -> list[tuple[list[str], str]]:
    """(fields, comment) of each line that is not blank or only a comment."""
    rows = []
    for line in path.read_text().splitlines():
        text, _, comment = line.partition("#")
        if text.split():
            rows.append((text.split(), comment.strip()))
    return rows


def image_packages() -> dict[str, tuple[str, str]]:
    """distribution -> (version on the image, '?' unknown, 'dep' with torch/transformers;
    what the rehearsal installs, '-' nothing of its own)."""
    out = {}
    for fields, _ in _rows(SCRIPTS / "gpu_image_packages.txt"):
        if len(fields) != 3:
            raise ValueError(f"scripts/gpu_image_packages.txt: {' '.join(fields)!r}: want NAME IMAGE_VERSION "
                             "REHEARSAL_REQUIREMENT")
        out[normalize(fields[0])] = (fields[1], fields[2])
    return out


def carried_wheels() -> dict[str, str]:
    """distribution -> pinned version, from scripts/gpu_wheels.txt (`name==version` lines)."""
    out = {}
    for fields, _ in _rows(SCRIPTS / "gpu_wheels.txt"):
        name, sep, version = fields[0].partition("==")
        if not sep or not version or len(fields) != 1:
            raise ValueError(f"scripts/gpu_wheels.txt: {' '.join(fields)!r}: want one NAME==VERSION a line")
        out[normalize(name)] = version
    return out


def not_carried() -> dict[str, str]:
    """distribution -> the feature that alone needs it, from scripts/gpu_not_carried.txt."""
    out = {}
    for fields, comment in _rows(SCRIPTS / "gpu_not_carried.txt"):
        if len(fields) != 1 or not comment:
            raise ValueError(f"scripts/gpu_not_carried.txt: {' '.join(fields)!r}: want NAME  # FEATURE")
        out[normalize(fields[0])] = comment
    return out


def floors() -> dict[str, str]:
    """distribution -> the lowest version pyproject.toml's dependencies accept (`>=`, or `==`)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:>=|==)\s*([0-9][0-9.]*)", dep)
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version ('1.85.3', '2.11.0+cu128' -> (2, 11, 0))."""
    return tuple(int(x) for x in re.findall(r"\d+", re.match(r"[0-9.]*", version).group(0)))


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def below_floor(name: str, version: str | None, lows: dict[str, str] | None = None) -> bool:
    low = (floors() if lows is None else lows).get(normalize(name))
    return version is None or (low is not None and version_tuple(version) < version_tuple(low))


def to_install() -> list[str]:
    """The carried distributions that are missing or installed below pyproject's floor."""
    lows = floors()
    return [name for name in carried_wheels() if below_floor(name, installed_version(name), lows)]


def problems() -> list[str]:
    """grpcio or protobuf imported below the floor the stubs need (empty: none)."""
    lows, out = floors(), []
    for dist, module in IMPORTED.items():
        try:
            found = __import__(module, fromlist=["__version__"])
        except ImportError as e:
            out.append(f"{dist}: cannot import {module}: {e}")
            continue
        version = getattr(found, "__version__", "?")
        if below_floor(dist, version, lows):
            out.append(f"{dist} {version} imported from {getattr(found, '__file__', '?')}: the stubs in pagedserve/wire/v1 need "
                       f">= {lows[dist]} (scripts/gpu_wheels/ has it: is it installed, and first on sys.path?)")
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["to-install"]:
        print(" ".join(to_install()))
    else:
        sys.exit("usage: gpu_packages.py to-install")
