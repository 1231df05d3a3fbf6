"""Settings declared once, as dataclass fields, and the flags made from them.

A service's config is a dataclass (`pagedserve.memsvc.config.MemsvcConfig`, ...) whose fields are
declared with `setting(...)`: default, help, and optionally the environment variable,
choices and metavar. From that one declaration come the flag `--field-name`, its fallback
`PAGEDSERVE_FIELD_NAME` (or the `env` named), `from_args` (namespace -> config) and
`to_argv` (config -> flags another process parses back to the same config). A field whose
type is a dataclass (TlsConfig, TracingConfig, MemoryConfig) contributes that dataclass's
flags, under the same names in every service; a field declared without `setting` is set in
process only (no flag).

A list field's flag is repeated for several values (`--replica A --replica B`), or with
`several=True` takes them after one flag too, as vLLM's `--served-model-name a b`.

`wiring=True` marks where a process listens and whom it calls (host, port, peer
addresses, metrics port): `pagedserve serve` chooses those itself for its children.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any

ENV_PREFIX = "PAGEDSERVE_"


def setting(default: Any = None, help: str = "", *, env: str | None = None,
            choices: list[str] | None = None, metavar: str | None = None, wiring: bool = False,
            name: str | None = None, secret: bool = False, several: bool = False):
    """A config field that is also a command-line flag (see the module docstring); `name`
    replaces the field's name in the flag, the namespace and the environment variable; a
    `secret` never goes into `to_argv` (visible in `ps`): `secret_env` passes it instead;
    `several`: a list's flag takes several values at once."""
    meta = {"help": help, "env": env, "choices": choices, "metavar": metavar, "wiring": wiring,
            "name": name, "secret": secret, "several": several}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def dest(f: dataclasses.Field) -> str:
    return f.metadata.get("name") or f.name


def flag_name(f: dataclasses.Field) -> str:
    return "--" + dest(f).replace("_", "-")


def env_name(f: dataclasses.Field) -> str:
    return ENV_PREFIX + (f.metadata.get("env") or dest(f).upper())


def _kind(cls, f: dataclasses.Field):
    """(base type, is_list) of a field: int | None -> (int, False); list[str] -> (str, True)."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return args[0], True
    if args:
        return args[0], False
    return hint, False


def settings_of(cls) -> list[tuple[type, dataclasses.Field]]:
    """Every (owning dataclass, field) that is a flag, nested dataclasses flattened."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += settings_of(hints[f.name])
        elif "help" in f.metadata:
            out.append((cls, f))
    return out


def _env_value(cls, f: dataclasses.Field):
    raw = os.environ.get(env_name(f))
    if raw is None or raw == "":
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    kind, is_list = _kind(cls, f)
    if is_list:
        return [kind(x) for x in raw.split()]
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def add_flags(parser, cls, *, only: typing.Iterable[str] | None = None,
              skip_wiring: bool = False, seen: set[str] | None = None,
              defaults: dict[str, Any] | None = None) -> None:
    """Add the flags of `cls` to `parser` (or an argument group). `only` limits them to
    those names; `seen` (names) skips flags already added by another config; `defaults`
    replaces a default where a command (a benchmark) needs its own."""
    only = set(only) if only is not None else None
    for owner, f in settings_of(cls):
        if (only is not None and dest(f) not in only) or (skip_wiring and f.metadata["wiring"]):
            continue
        if seen is not None:
            if dest(f) in seen:
                continue
            seen.add(dest(f))
        kind, is_list = _kind(owner, f)
        default = _env_value(owner, f)
        if defaults and dest(f) in defaults and os.environ.get(env_name(f)) in (None, ""):
            default = defaults[dest(f)]
        shown = "off" if default is None else default
        if kind is bool:
            shown = "on" if default else "off"
        elif f.metadata["secret"] and default is not None:
            shown = "set, not shown"  # from the environment: --help must not print it
        help_text = f"{f.metadata['help']} (env {env_name(f)}; default {shown})"
        kwargs: dict[str, Any] = {"dest": dest(f), "default": default, "help": help_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
            if f.metadata["metavar"]:
                kwargs["metavar"] = f.metadata["metavar"]
            if is_list:
                several = f.metadata.get("several")
                kwargs["action"] = "extend" if several else "append"
                if several:
                    kwargs["nargs"] = "+"
                kwargs["default"] = None
                kwargs["help"] = help_text.replace("; default", "; several after the flag or the flag "
                                                   "repeated; default" if several else
                                                   "; repeat for several; default")
        parser.add_argument(flag_name(f), **kwargs)
    return None


def from_args(cls, args: argparse.Namespace, **overrides):
    """`cls` from a parsed namespace; fields the namespace lacks keep their defaults."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = from_args(hints[f.name], args)
        elif "help" in f.metadata and hasattr(args, dest(f)):
            value = getattr(args, dest(f))
            if value is None and _kind(cls, f)[1]:
                value = _env_value(cls, f)  # an append flag given nowhere: env or default
            values[f.name] = value
    return cls(**values)


def to_argv(config, only: typing.Iterable[str] | None = None) -> list[str]:
    """Flags that make another process's parser build the same config (`only`: just those
    names). Every field is written, not only the changed ones, so the child's environment
    cannot override it."""
    only = set(only) if only is not None else None
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            argv += to_argv(value, only)
        elif ("help" not in f.metadata or value is None or f.metadata["secret"]
              or (only is not None and dest(f) not in only)):
            continue
        elif isinstance(value, bool):
            argv.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        elif isinstance(value, list):
            for item in value:
                argv += [flag_name(f), str(item)]
        else:
            argv += [flag_name(f), str(value)]
    return argv


def secret_env(config) -> dict[str, str]:
    """The environment that hands a child process the secrets `to_argv` leaves out."""
    env: dict[str, str] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            env.update(secret_env(value))
        elif f.metadata.get("secret") and value is not None:
            env[env_name(f)] = str(value)
    return env
