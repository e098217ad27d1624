"""A run's configuration: one documented dataclass per section, loaded from YAML plus overrides.

`RunConfig` (`run.py`) holds one field per section; `load_config` (`load.py`) reads a recipe and
dotted overrides and validates them, naming the key, the file and the line. Every process imports
this package; it imports no process's code.
"""

from megatron_darl.config.load import ConfigError, load_config, save_resolved, to_yaml
from megatron_darl.config.run import RunConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "save_resolved", "to_yaml"]
