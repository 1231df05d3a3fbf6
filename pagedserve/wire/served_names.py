"""The names a model is served under (--served-model-name, as vLLM's): the first is the one
responses report (ModelInfo.name), a request naming any is served (ModelInfo.aliases hold
the others), /v1/models and ListModels list them all.

The setting is declared once, here, for the executor's config (its ModelInfo.name, its
metrics) and the gateway's (what the APIs serve; `pagedserve serve` gives both the same).
The executor sends one name; the gateway sets ModelInfo.aliases from its own setting.
`named(info, names)` is `info` under `names` (itself when there are none); `names_of(info)`
every name it answers to; `serves(info, model)` whether a request naming `model` (empty:
any) is served.
"""
from __future__ import annotations

import dataclasses

from pagedserve.wire.protocol import ModelInfo
from pagedserve.wire.settings import setting


def served_model_name_setting():
    """The `--served-model-name` field of the executor's and the gateway's configs."""
    return setting([], "the names clients ask for in `model`, several after one flag as vLLM's: "
                   "the first is the name responses report, /v1/models lists them all, a request "
                   "naming any is served (off: the hub id, else the directory's or .gguf file's "
                   "name; a gateway on its own: the executor's name)", metavar="NAME", several=True)


def named(info: ModelInfo, names: list[str]) -> ModelInfo:
    if not names:
        return info
    unique = list(dict.fromkeys(names))
    return dataclasses.replace(info, name=unique[0], aliases=unique[1:])


def names_of(info: ModelInfo) -> list[str]:
    return [info.name, *info.aliases]


def serves(info: ModelInfo, model: str | None) -> bool:
    return not model or model in names_of(info)
