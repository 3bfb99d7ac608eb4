"""User-supplied functions named by import path in the config ('package.module:function')."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from dapo_mcore.utils.errors import ConfigError


def import_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} must be given as 'package.module:function'")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{what} {spec!r} cannot be loaded: {err}") from None
    if not callable(found):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return found
