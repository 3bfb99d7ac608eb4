"""User-supplied functions named by import path in the config ('package.module:function')."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from dapo_mcore.utils.errors import ConfigError


def import_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    """'package.module:function', or 'path/to/file.py:function' (a file of its own, as verl's reward files are
    named: custom_reward_function.path and .name)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} must be given as 'package.module:function' or 'path/file.py:function'")
    try:
        module = _file_module(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        found = getattr(module, attr)
    except (ImportError, AttributeError, OSError, SyntaxError) as err:
        raise ConfigError(f"{what} {spec!r} cannot be loaded: {err}") from None
    if not callable(found):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return found


def _file_module(path: str) -> ModuleType:
    """The module of a .py file, imported once per process under a name of its resolved path."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise ImportError(f"no such file: {path}")
    name = f"dapo_user_file_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module
