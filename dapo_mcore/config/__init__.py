"""The typed config tree, its YAML loader and its checks."""

from dapo_mcore.config.loader import all_keys, dump_config, load_config, parse_override
from dapo_mcore.config.schema import RunConfig
from dapo_mcore.config.validate import validate

__all__ = ["RunConfig", "all_keys", "dump_config", "load_config", "parse_override", "validate"]
