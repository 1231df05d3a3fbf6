"""Packages that only one feature needs, imported when that feature is used.

Contract: `require(module, package, feature)` imports `module` and returns it; when it cannot
be imported it raises MissingPackage (an ImportError) whose message names the pip package to
install, the feature that needs it and, where there is one, the setting that turns the
feature off. Nothing is imported before the feature asks, so a service started without the
package runs as long as the feature is not asked for. `available(module)` tells whether
`module` can be imported, without importing it.
"""
from __future__ import annotations

import importlib
import importlib.util


class MissingPackage(ImportError):
    """A feature was asked for whose package is not installed; the message says which."""


def require(module: str, package: str, feature: str, off: str | None = None):
    """`module` imported; MissingPackage naming `package` and `feature` when it cannot be."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = f", or {off}" if off else ""
        raise MissingPackage(f"{feature} needs the Python package {package!r}, which is not installed "
                             f"(import {module}: {e}): pip install {package}{hint}", name=module) from e


def available(module: str) -> bool:
    """Whether `module` can be imported (its parent packages are imported to find out)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False
