"""Run configuration: the composition of every role's config, loaded from YAML plus overrides.

What it is: `RunConfig` (one field per role, each a typed dataclass defined in that role's
`api.py`), `load_config(path, overrides)` which merges a YAML recipe and dotted command-line
overrides (`replay.k=4`; a leading `+` is accepted as Hydra/verl users type it) through
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
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from megatron_darl.data.api import DataConfig
from megatron_darl.eval.api import EvalConfig
from megatron_darl.launch.api import LaunchConfig
from megatron_darl.learner.api import (
    AlgorithmConfig,
    LearnerConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
)
from megatron_darl.replay.api import ReplayConfig, StalenessConfig
from megatron_darl.rollout.api import RolloutConfig
from megatron_darl.rollout.rewards.api import RewardConfig


@dataclass
class TrainConfig:
    """The outer loop."""

    steps: int = 100  # train steps (= weight versions published)
    batch_prompts: int = 32  # groups per train step (x rollout.group_size sequences)
    seed: int = 1234
    run_dir: str = "runs/default"  # everything a run writes goes under it
    sft_steps: int = 0  # supervised warm start before RL (CPU demo); cached in run_dir
    # the warm start stops once its greedy accuracy on the held-out problems reaches this
    # (0: it runs all sft_steps); a target, not a step count, is what stays put across machines
    sft_target: float = 0.0
    # each step lasts at least this long: the learner sleeps the rest after publishing. Emulates
    # a learner on its own hardware that is slower than generation, so that on a small shared
    # machine generation runs ahead and trained data reaches the staleness bound (experiments)
    min_step_s: float = 0.0

    def check(self) -> list[tuple[str, str]]:
        errs = []
        if self.min_step_s < 0:
            errs.append(("min_step_s", "must be >= 0 (0: no pacing)"))
        if self.steps < 0:
            errs.append(("steps", "must be >= 0"))
        if not 0.0 <= self.sft_target < 1.0:
            errs.append(("sft_target", "must be in [0, 1) (a held-out accuracy; 0: run all sft_steps)"))
        if self.batch_prompts < 1:
            errs.append(("batch_prompts", "must be >= 1"))
        if not self.run_dir:
            errs.append(("run_dir", "must not be empty"))
        return errs


@dataclass
class CheckpointConfig:
    every_steps: int = 50  # save every N steps (0: only on preemption and at the end)
    keep_last: int = 2  # older checkpoints are deleted
    resume: str = "none"  # none | auto (latest in run_dir/checkpoints) | a checkpoint path
    dir: str = ""  # empty: <train.run_dir>/checkpoints

    def check(self) -> list[tuple[str, str]]:
        errs = []
        if self.every_steps < 0:
            errs.append(("every_steps", "must be >= 0"))
        if self.keep_last < 1:
            errs.append(("keep_last", "must be >= 1"))
        return errs


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # scalars and histograms under <run_dir>/tb
    jsonl: bool = True  # one JSON line of metrics per step in <run_dir>/metrics.jsonl
    progress: bool = True  # progress bar with step, reward and ETA
    histogram_every: int = 10  # TensorBoard histograms (staleness, reuse) every N steps; scalars every step

    def check(self) -> list[tuple[str, str]]:
        return [("histogram_every", "must be >= 1")] if self.histogram_every < 1 else []


@dataclass
class RunConfig:
    """Everything a run needs; `darl-train --print-config` shows it resolved."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {}

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.train.run_dir, "checkpoints")

    def check(self) -> list[tuple[str, str]]:
        """Combinations that are invalid although each key is valid alone."""
        errs: list[tuple[str, str]] = []
        if self.replay.pmis and self.algo.policy_loss != "darl":
            errs.append(("replay.pmis", f"the per-version objective needs algo.policy_loss=darl "
                         f"(got {self.algo.policy_loss!r}); set replay.pmis=false for baselines"))
        if self.replay.pmis_beta == "balance":
            if not self.replay.pmis or self.algo.policy_loss != "darl":
                errs.append(("replay.pmis_beta", "balance weighs D-ARL's per-version objective: it needs "
                             "replay.pmis=true and algo.policy_loss=darl"))
            if self.algo.rollout_is not in (None, "token"):
                errs.append(("replay.pmis_beta", f"balance weights are per token: it needs algo.rollout_is=token "
                             f"or null (got {self.algo.rollout_is!r})"))
        if self.replay.sg and not self.replay.enable:
            errs.append(("replay.sg", "variance-guided selection needs replay.enable=true"))
        if self.replay.sg and not self.algo.recompute_proximal:
            errs.append(("replay.sg", "selection scores use proximal log-probs: set "
                         "algo.recompute_proximal=true or replay.sg=false"))
        if self.rollout.weight_sync == "nccl":
            errs.append(("rollout.weight_sync", "'nccl' is now called 'distributed' (NCCL on GPUs, gloo on "
                         "CPU, through SGLang's /update_weights_from_distributed): set rollout.weight_sync=distributed"))
        if self.rollout.backend == "sglang" and self.rollout.weight_sync == "shm":
            errs.append(("rollout.weight_sync", "SGLang servers load weights from disk or a broadcast, "
                         "not from this node's shared memory; use disk, distributed or auto"))
        return errs


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
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. replay.k=4")
        key, _, raw = text.partition("=")
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
