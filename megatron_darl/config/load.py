"""Loading a run's config: a YAML recipe plus dotted overrides, validated, saved with the run.

What it is: `load_config(path, overrides)` which merges a YAML recipe and dotted command-line
overrides (`algo.k=4`; a leading `+` is accepted as Hydra/verl users type it) through
OmegaConf structured configs, and validation that names the key, the file and the line, and
the allowed values. Nothing starts on an invalid config.
What it is not: a place for derived values (they are properties on the dataclasses) or for
any behaviour of the roles.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from megatron_darl.config.run import RunConfig


class ConfigError(ValueError):
    """An invalid configuration; the message names every bad key and where it came from."""


def _yaml_lines(text: str) -> dict[str, int]:
    """Map each dotted key of a YAML document to its 1-based line number."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    walk(yaml.compose(text), "")
    return lines


def _allowed_keys(full_key: str) -> list[str]:
    """Field names of the dataclass that holds `full_key` (its parent path)."""
    node: Any = RunConfig
    for part in full_key.split(".")[:-1]:
        hints = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return []
        f = hints[part]
        node = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def _explain(exc: OmegaConfBaseException, where: str) -> str:
    key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError):
        allowed = _allowed_keys(key)
        leaf = key.split(".")[-1]
        close = difflib.get_close_matches(leaf, allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown key {key!r} ({where}).{hint} Allowed keys here: {', '.join(allowed)}"
    msg = str(exc).split("\n")[0]
    if "Interpolation" in type(exc).__name__:
        msg += " (`${...}` refers to another key; write a literal `${` as `\\${`)"
    return f"bad value for {key!r} ({where}): {msg}"


# Keys that moved to another section: a recipe or an override that still uses one stops with the new
# name (one name per knob: the old ones are not translated). D-ARL's knobs were split over three
# sections (algo, replay, staleness); the ring buffer's settings sat beside them in `replay`; the
# CPU demo's warm start and pacing sat in `train`.
MOVED_KEYS: dict[str, str] = {
    "replay.enable": "algo.replay", "replay.k": "algo.k", "replay.max_reuse": "algo.max_reuse",
    "replay.warmup": "algo.warmup", "replay.sg": "algo.sg", "replay.sg_quantile": "algo.sg_quantile",
    "replay.sg_tau_abs": "algo.sg_tau_abs", "replay.sg_tau_floor": "algo.sg_tau_floor",
    "replay.sg_fill": "algo.sg_fill", "replay.pmis": "algo.pmis", "replay.pmis_beta": "algo.pmis_beta",
    "replay.balance_snapshots": "algo.balance_snapshots",
    "replay.ring_bytes": "ring.size_bytes", "replay.ring_name": "ring.name", "replay.ring_checksum": "ring.checksum",
    "staleness.max_head_offpolicyness": "algo.max_head_offpolicyness",
    "train.sft_steps": "demo.sft_steps", "train.sft_target": "demo.sft_target", "train.min_step_s": "demo.min_step_s",
}
_MOVED_SECTIONS = {"replay": "algo and ring", "staleness": "algo"}


def _moved(key: str) -> str | None:
    """Where an old key lives now, as a sentence; None for a key that did not move."""
    if key in MOVED_KEYS:
        return f"{key!r} moved to {MOVED_KEYS[key]!r}"
    section = key.split(".")[0]
    if section in _MOVED_SECTIONS:
        return f"the {section!r} section is gone: its keys moved to {_MOVED_SECTIONS[section]} ({key!r})"
    return None


def _moved_in_file(data: dict, lines: dict[str, int], path: str) -> list[str]:
    """Every old key of a recipe (a section's keys, or an old section that is not a mapping),
    with its file and line."""
    found = []
    for key, line in lines.items():
        parts = key.split(".")
        section_value = parts[0] in _MOVED_SECTIONS and len(parts) == 1 and not isinstance(data.get(key), dict)
        if (len(parts) == 2 or section_value) and _moved(key):
            found.append(f"{_moved(key)} ({path}:{line})")
    return found


def _merge_file(schema: Any, path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    lines = _yaml_lines(text)
    moved = _moved_in_file(data, lines, path)
    if moved:
        raise ConfigError(f"{path}: keys of an older layout:\n  " + "\n  ".join(moved))
    try:
        return OmegaConf.merge(schema, OmegaConf.create(data))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        raise ConfigError(_explain(exc, f"{path}:{lines.get(key, '?')}")) from None


def _key_type(full_key: str) -> Any:
    """The declared type of a dotted key (`data.prompt_template` -> str), or None when the key is
    not a dataclass field (a dict entry such as `data.dataset_kwargs.min_terms`, or unknown)."""
    node: Any = RunConfig
    hint: Any = None
    for part in full_key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        hint = node = hints[part]
    return hint


def _is_text(hint: Any) -> bool:
    """str or Optional[str]."""
    return hint is str or (typing.get_origin(hint) in (typing.Union, types.UnionType)
                           and set(typing.get_args(hint)) == {str, type(None)})


def _override_patch(key: str, raw: str) -> Any:
    """One override as a config to merge. A text key takes the text as typed (`{question}`,
    `Q: {question} A:` are templates, not YAML mappings), quotes removed, `null` for None where
    allowed; `${other.key}` stays an interpolation. Other keys parse as YAML values."""
    hint = _key_type(key)
    if hint is None or not _is_text(hint):
        try:
            return OmegaConf.from_dotlist([f"{key}={raw}"])
        except yaml.YAMLError as exc:
            detail = " ".join(str(exc).split())
            raise ConfigError(f"override {key}={raw!r}: the value is not valid YAML ({detail})") from None
    value: Any = raw
    if raw in ("null", "~"):
        value = None  # refused by a key that is not optional, with the key named
    elif len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        try:
            value = yaml.safe_load(raw)  # a quoted YAML string: its quotes and escapes are YAML's
        except yaml.YAMLError:
            value = raw  # quotes that are part of the text ("a" or "b")
    patch = OmegaConf.create()
    OmegaConf.update(patch, key, value, force_add=True)
    return patch


def _merge_overrides(cfg: Any, overrides: list[str]) -> Any:
    for item in overrides:
        text = item[1:] if item.startswith("+") else item  # Hydra's "add key" prefix, accepted
        if "=" not in text or text.startswith("="):
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. algo.k=4")
        key, _, raw = text.partition("=")
        moved = _moved(key.strip())
        if moved:
            raise ConfigError(f"command-line override {item!r}: {moved}")
        try:
            cfg = OmegaConf.merge(cfg, _override_patch(key.strip(), raw))
        except OmegaConfBaseException as exc:
            raise ConfigError(_explain(exc, f"command-line override {item!r}")) from None
    return cfg


def validate(obj: Any, prefix: str = "") -> list[str]:
    """Walk the config tree: allowed string values (`_choices`) and each node's `check()`."""
    errors: list[str] = []
    for name, allowed in getattr(obj, "_choices", {}).items():
        value = getattr(obj, name)
        if value is not None and value not in allowed:
            errors.append(f"{prefix}{name}={value!r}: allowed values are {', '.join(map(repr, allowed))}")
    check = getattr(obj, "check", None)
    if callable(check):
        for key, msg in check():
            errors.append(f"{prefix}{key}: {msg}")
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            errors.extend(validate(value, f"{prefix}{f.name}."))
    return errors


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """YAML recipe (optional) + dotted overrides -> a validated RunConfig, or ConfigError."""
    cfg: Any = OmegaConf.structured(RunConfig)
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        cfg = _merge_file(cfg, path)
    cfg = _merge_overrides(cfg, list(overrides or []))
    try:
        run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, "resolving the config")) from None
    errors = validate(run)
    if errors:
        src = f" (from {path})" if path else ""
        raise ConfigError(f"invalid config{src}:\n  " + "\n  ".join(errors))
    return run


def _escape_interpolations(value: Any) -> Any:
    """Resolved text that contains a literal `${` (written `\\${` by the user) keeps its escape, so
    that the saved config loads back to the same value instead of an interpolation."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape_interpolations(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_interpolations(v) for v in value]
    return value


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(_escape_interpolations(dataclasses.asdict(cfg))))


def save_resolved(cfg: RunConfig, run_dir: str | None = None) -> str:
    """Write the resolved config to <run_dir>/config.yaml (atomically) and return the path."""
    run_dir = run_dir or cfg.train.run_dir
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(to_yaml(cfg))
    os.replace(tmp, path)
    return path
