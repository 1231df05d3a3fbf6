"""The native model families, each declared in its own module (family.py says what a
declaration holds), and the lookups through which config, weights, loading, GGUF conversion
and sharding read them. Adding a family: its module, and its name in the tuple below."""
from __future__ import annotations

from pagedserve.executor.models import gemma, llama, mixtral, phi3
from pagedserve.executor.models.family import Family

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family`; ValueError when its name, an architecture or a GGUF architecture is taken."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered already")
    for arch in family.architectures:
        if for_architecture(arch) is not None:
            raise ValueError(f"architecture {arch!r} belongs to family {for_architecture(arch).name!r}")
    for arch in family.gguf.architectures if family.gguf else ():
        if for_gguf(arch) is not None:
            raise ValueError(f"GGUF architecture {arch!r} belongs to family {for_gguf(arch).name!r}")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    del _FAMILIES[name]


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def architectures() -> tuple[str, ...]:
    """Every config.json architecture a native family computes, in registration order."""
    return tuple(arch for f in _FAMILIES.values() for arch in f.architectures)


def gguf_architectures() -> tuple[str, ...]:
    return tuple(arch for f in _FAMILIES.values() if f.gguf for arch in f.gguf.architectures)


def for_architecture(architecture: str) -> Family | None:
    return next((f for f in _FAMILIES.values() if architecture in f.architectures), None)


def for_gguf(gguf_architecture: str) -> Family | None:
    return next((f for f in _FAMILIES.values() if f.gguf and gguf_architecture in f.gguf.architectures), None)


def named(name: str) -> Family:
    return _FAMILIES[name]


for _family in (llama.FAMILY, gemma.GEMMA2, gemma.GEMMA3, phi3.FAMILY, mixtral.FAMILY):
    register(_family)
