"""YAML recipes with `defaults:` inheritance, dotted command-line overrides and strict keys.

A recipe names the files it inherits under `defaults:` (paths relative to the recipe), and holds only its
differences. Its `name` (and so its run directory, runs/<name>) is its own: written in the file, or the file's
stem; never inherited, so that a recipe derived from another never continues the other's run. Overrides are
`section.key=value` with YAML values. An unknown key anywhere is an error that names the key, where it came
from, and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from dapo_mcore.config.schema import RunConfig
from dapo_mcore.utils.errors import ConfigError

_DEFAULTS_KEY = "defaults"
_ABSENT = "(absent)"  # a key one of two configs compared has not got (config_changes)
_BOOL_TAG = "tag:yaml.org,2002:bool"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true / false. YAML 1.1 also reads on / off / yes /
    no as booleans, which turned `trainer.packing=off` into False."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


# values of a key that were renamed: what to write instead
_RENAMED_VALUES = {
    ("algorithm.mismatch.tis", "token_mask"): "token_mask was renamed token_reject (it drops out-of-band tokens from "
    "the denominator, verl's token rejection); IcePop as published is tis=icepop",
}

# where the schema wants a boolean, YAML 1.1's spellings still mean one
_YAML11_BOOLS = {"yes": True, "on": True, "no": False, "off": False}


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Resolve a recipe (with its defaults chain) and overrides into a checked RunConfig."""
    merged: dict[str, Any] = {}
    if path is not None:
        merged = _load_recipe(Path(path), chain=())
    for override in overrides:
        key, value = parse_override(override)
        _check_keys(_nest(key, value), RunConfig, source=f"override '{override}'")
        merged = _deep_merge(merged, _nest(key, value))
    return _build(RunConfig, merged, prefix="")


def parse_override(text: str) -> tuple[str, Any]:
    """'algorithm.clip_high=0.3' -> ('algorithm.clip_high', 0.3); values are parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:  # its text spans several lines of parser context: the problem's line alone
        context, problem = getattr(err, "context", None), getattr(err, "problem", None) or str(err).splitlines()[0]
        problem = f"{context}: {problem}" if context else problem
        raise ConfigError(
            f"override '{text}': the value is not valid YAML ({problem}); quote it to pass text, e.g. {key}='{raw}'"
        ) from None
    return key.strip(), value


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_changes(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, old, new) for every leaf that differs between two config_to_dict trees (keys only one has
    included, as "(absent)": a save from an older version, a key added since)."""
    changes = []
    for key in list(now) + [k for k in saved if k not in now]:
        old, new = saved.get(key, _ABSENT), now.get(key, _ABSENT)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += config_changes(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append((f"{prefix}{key}", old, new))
    return changes


def describe_change(change: tuple[str, Any, Any]) -> str:
    key, old, new = change
    return f"{key}: {old!r} -> {new!r}"


# What a resumed run may set otherwise and still be the same experiment (checkpoint.resume=auto refuses any
# other change, checkpoint.resume=force takes it): how long it runs and where its files are; how it is named,
# logged, saved, timed out and evaluated on held-out files; its layout (saves reload at another one); the speed
# and memory settings whose gradients the tests hold equal (micro-batch splits, packing, recompute, fused
# heads, offloading) and the engine's serving settings. What is behind a path is checked on its own: a data
# file by its hash, the model's shape against the save. Patterns as fnmatch.
SAME_EXPERIMENT_KEYS = (
    "name", "note", "logging.*", "checkpoint.*", "parallel.*", "*timeout*",
    "trainer.steps", "trainer.eval_*", "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch",
    "trainer.packing",
    "model.hf_path", "model.mcore_path", "model.init", "model.transformer_impl", "model.recompute*",
    "model.fused_*", "model.logprob_chunk_size", "model.moe_token_dispatcher",
    "data.source", "data.eval_files", "data.allow_changed_data",
    "optimizer.cpu_offload", "optimizer.offload_fraction",
    "algorithm.reward.workers", "algorithm.mismatch.guard*",
    "rollout.engine", "rollout.engine_tp_size", "rollout.weight_bucket_mb", "rollout.verify_*",
    "rollout.gpu_memory_utilization", "rollout.cpu_kv_cache_mb", "rollout.max_num_batched_tokens",
    "rollout.max_model_len", "rollout.enable_prefix_caching", "rollout.cuda_graphs", "rollout.sleep_level",
    "rollout.offload_actor",
)  # fmt: skip


def changes_the_experiment(change: tuple[str, Any, Any]) -> bool:
    """A (key, old, new) change that makes another experiment: not in SAME_EXPERIMENT_KEYS, and not a key a save
    from an older version lacks and that holds its default now (nor one this version no longer has): a job
    re-queued after an upgrade that added a key continues its run."""
    key, old, new = change
    if any(fnmatch.fnmatchcase(key, pattern) for pattern in SAME_EXPERIMENT_KEYS):
        return False
    if new == _ABSENT:  # a key this version no longer has, unless an entry of a mapping (reward.verifiers) went
        return _in_a_mapping(key)
    return not (old == _ABSENT and _value_at(config_to_dict(RunConfig()), key) == new)


def _in_a_mapping(key: str) -> bool:
    """An entry of a mapping-valued key (algorithm.reward.verifiers.<source>), not a key of the schema."""
    return any(key.startswith(f"{leaf}.") for leaf in all_keys())


def _value_at(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config; loading that file again gives the same config."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema, e.g. 'algorithm.overlong.buffer_len'."""
    keys = []
    for f in dataclasses.fields(cls):
        ftype = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(ftype):
            keys += all_keys(ftype, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _load_recipe(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"recipe defaults form a cycle: {cycle}")
    if not path.is_file():
        where = f" (named in defaults of {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        raw = _load_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    parents = raw.pop(_DEFAULTS_KEY, None) or []
    if isinstance(parents, str):
        parents = [parents]
    _check_keys(raw, RunConfig, source=str(path))
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = _deep_merge(merged, _load_recipe(path.parent / parent, (*chain, path)))
    merged["name"] = raw.pop("name", None) or path.stem  # the run's name is the recipe's own (module doc)
    return _deep_merge(merged, raw)


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_keys(raw: dict[str, Any], cls: type, source: str, prefix: str = "") -> None:
    types_ = _field_types(cls)
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in types_:
            raise ConfigError(f"unknown config key '{dotted}' in {source}{_suggest(dotted)}")
        if dataclasses.is_dataclass(types_[key]):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"'{dotted}' in {source} is a section; give it keys ({', '.join(_field_types(types_[key]))})"
                )
            _check_keys(value, types_[key], source, prefix=f"{dotted}.")


def _suggest(dotted: str) -> str:
    candidates = all_keys() + [f.name for f in dataclasses.fields(RunConfig)]
    close = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.6)
    if not close:  # a right leaf under the wrong section: 'rollout.clip_high' -> 'algorithm.clip_high'
        leaf = dotted.rsplit(".", 1)[-1]
        close = [k for k in candidates if k.rsplit(".", 1)[-1] == leaf][:1]
    return f"; did you mean '{close[0]}'?" if close else ""


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    kwargs = {}
    for name, ftype in _field_types(cls).items():
        if name not in raw:
            continue
        dotted = f"{prefix}{name}"
        if dataclasses.is_dataclass(ftype):
            kwargs[name] = _build(ftype, raw[name], f"{dotted}.")
        else:
            kwargs[name] = _coerce(raw[name], ftype, dotted)
    return cls(**kwargs)


def _coerce(value: Any, ftype: Any, dotted: str) -> Any:
    """Check (and widen int->float) one leaf value against its annotated type."""
    origin = typing.get_origin(ftype)
    if origin in (Union, types.UnionType):
        options = typing.get_args(ftype)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _coerce(value, inner, dotted)
    if origin is Literal:
        choices = typing.get_args(ftype)
        if value not in choices:
            if (dotted, value) in _RENAMED_VALUES:
                raise ConfigError(f"'{dotted}': {_RENAMED_VALUES[dotted, value]}")
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"'{dotted}' must be one of {list(choices)}, got {value!r}{hint}")
        return value
    if origin is dict:  # a YAML mapping; on the command line key.name=value (nested) or "a=x,b=y"
        if isinstance(value, str):
            pairs = [part.split("=", 1) for part in value.split(",") if part.strip()]
            if any(len(pair) != 2 for pair in pairs):
                raise ConfigError(f"'{dotted}' must be a mapping, e.g. {{a: x}} or a=x,b=y, got {value!r}")
            value = {k.strip(): v.strip() for k, v in pairs}
        if not isinstance(value, dict):
            raise ConfigError(f"'{dotted}' must be a mapping, e.g. {{a: x}}, got {value!r}")
        key_type, value_type = typing.get_args(ftype)
        return {_coerce(k, key_type, dotted): _coerce(v, value_type, f"{dotted}.{k}") for k, v in value.items()}
    if origin is list:  # a YAML list ([a, b]); a plain string is one item, or several comma-separated
        items = [part.strip() for part in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"'{dotted}' must be a list, e.g. [a, b], got {value!r}")
        (item_type,) = typing.get_args(ftype)
        return [_coerce(item, item_type, dotted) for item in items if item != ""]
    if ftype is bool:
        value = _YAML11_BOOLS.get(value.lower(), value) if isinstance(value, str) else value
        if not isinstance(value, bool):
            raise ConfigError(f"'{dotted}' must be true or false, got {value!r}")
        return value
    if ftype is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"'{dotted}' must be an integer, got {value!r}")
        return value
    if ftype is float:
        # PyYAML (YAML 1.1) reads 1e-6 as a string
        number = _float_or_none(value) if isinstance(value, str) else value
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"'{dotted}' must be a number, got {value!r}")
        return float(number)
    if ftype is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"'{dotted}' must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"'{dotted}': unsupported config type {ftype}")


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
