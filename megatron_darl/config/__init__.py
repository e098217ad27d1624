"""A run's configuration: one documented dataclass per section, loaded from YAML plus overrides.

`RunConfig` (`run.py`) holds one field per section; `load_config` (`load.py`) reads a recipe and
dotted overrides and validates them, naming the key, the file and the line. Every process imports
this package; it imports no process's code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_darl.config.load import ConfigError, load_config, save_resolved, to_yaml
    from megatron_darl.config.run import RunConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "save_resolved", "to_yaml"]
# Loaded on first use: a process that needs one section (a reward worker reads only
# `config.rewards`) does not import every section's module, and through `algo`, torch.
_WHERE = {"ConfigError": "load", "load_config": "load", "save_resolved": "load", "to_yaml": "load", "RunConfig": "run"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
