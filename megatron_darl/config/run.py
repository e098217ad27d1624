"""The run's config: `RunConfig`, one field per section, and the sections of the run itself.

What it is: `RunConfig` (what `darl-train --print-config` prints), the `train`, `demo`, `ring`,
`checkpoint` and `logging` sections, and the checks that involve several sections. The other
sections are defined beside their subject: `algo` (every D-ARL knob) in `algo/config.py`, the
rest in this folder.
What it is not: loading, overrides and validation (`load.py`), or any behaviour of the processes.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.config.data import DataConfig
from megatron_darl.config.eval import EvalConfig
from megatron_darl.config.launch import LaunchConfig
from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
from megatron_darl.config.rewards import RewardConfig
from megatron_darl.config.rollout import RolloutConfig


@dataclass
class TrainConfig:
    """The outer loop."""

    steps: int = 100  # train steps (= weight versions published)
    batch_prompts: int = 32  # groups per train step (x rollout.group_size sequences)
    seed: int = 1234  # seeds the model's init, sampling and the minibatch partition
    run_dir: str = "runs/default"  # everything a run writes goes under it
    # the sample budget: the run stops at the first step boundary at which the rollout side has
    # generated this many samples (written to the ring plus those of groups the equal-reward filter
    # dropped: `eval.periodic.samples_generated`), evaluating and exporting as at a normal end;
    # train.steps stays a cap. 0: off (the run stops at train.steps)
    max_generated_samples: int = 0
    # the longest a step waits for rollouts; past it the run stops naming the step, what the
    # learner holds and the rollout manager's last report (0: no bound)
    data_wait_timeout_s: float = 3600.0

    def check(self) -> list[tuple[str, str]]:
        errs = []
        if not self.data_wait_timeout_s >= 0:
            errs.append(("data_wait_timeout_s", "must be >= 0 (0: no bound)"))
        if self.steps < 0:
            errs.append(("steps", "must be >= 0"))
        if self.max_generated_samples < 0:
            errs.append(("max_generated_samples", "must be >= 0 (0: no sample budget, the run stops at train.steps)"))
        if self.batch_prompts < 1:
            errs.append(("batch_prompts", "must be >= 1"))
        if not self.run_dir:
            errs.append(("run_dir", "must not be empty"))
        return errs


@dataclass
class DemoConfig:
    """The CPU testbed: the built-in model's warm start (`model.hf_dir: builtin:tiny-qwen3`) and
    learner pacing for staleness experiments. A run on a model of its own leaves them at 0."""

    sft_steps: int = 0  # supervised warm start of the built-in model before RL; cached in run_dir
    # the warm start stops once its greedy accuracy on the held-out problems reaches this
    # (0: it runs all sft_steps); a target, not a step count, is what stays put across machines
    sft_target: float = 0.0
    # with rollout.tool: the share of warm-start answers that call the tool (call the expression,
    # read the answer, copy it; launch/warmstart.py) rather than answer at once. Below 1, the warm
    # start leaves tool use to RL to learn (configs/cpu_demo_tools.yaml)
    sft_tool_fraction: float = 0.0
    # each step lasts at least this long: the learner sleeps the rest after publishing. Emulates
    # a learner on its own hardware that is slower than generation, so that on a small shared
    # machine generation runs ahead and trained data reaches the staleness bound (experiments)
    min_step_s: float = 0.0

    def check(self) -> list[tuple[str, str]]:
        errs = []
        if self.sft_steps < 0:
            errs.append(("sft_steps", "must be >= 0"))
        if not 0.0 <= self.sft_target < 1.0:
            errs.append(("sft_target", "must be in [0, 1) (a held-out accuracy; 0: run all sft_steps)"))
        if not 0.0 <= self.sft_tool_fraction <= 1.0:
            errs.append(("sft_tool_fraction", f"{self.sft_tool_fraction}: must be in [0, 1]"))
        if self.min_step_s < 0:
            errs.append(("min_step_s", "must be >= 0 (0: no pacing)"))
        return errs


@dataclass
class RingConfig:
    """The on-node shared-memory ring buffer that carries trajectories from the rollout manager to
    the trainer (`channel/shm_ring.py`)."""

    size_bytes: int = 268435456  # bytes under /dev/shm (256 MiB); a record never spans more than the ring
    name: str | None = None  # segment name under /dev/shm; None: the launcher derives one per run and node
    checksum: bool | None = None  # crc32 per record; None: on unless the CPU is x86-64 (see shm_ring.py)

    @property
    def effective_checksum(self) -> bool:
        """Checksums are needed where stores may become visible out of order (not x86-64)."""
        if self.checksum is not None:
            return self.checksum
        return platform.machine().lower() not in ("x86_64", "amd64")

    def check(self) -> list[tuple[str, str]]:
        errs = []
        if self.size_bytes < 1 << 16:
            errs.append(("size_bytes", "must be >= 65536 (a record never spans more than the ring)"))
        if self.name is not None and (not self.name or "/" in self.name):
            errs.append(("name", "must be a non-empty file name without '/'"))
        return errs


@dataclass
class CheckpointConfig:
    """Training checkpoints (`<run_dir>/checkpoints/step_N`, Megatron's dist_checkpointing)."""

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
    """Where a run's metrics go (the processes' own logs are always `<run_dir>/logs/<role>.log`)."""

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
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {}

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.train.run_dir, "checkpoints")

    def check(self) -> list[tuple[str, str]]:
        """Combinations of sections that are invalid although each section is valid alone."""
        errs: list[tuple[str, str]] = []
        if self.rollout.backend == "sglang" and self.rollout.weight_sync == "shm":
            errs.append(("rollout.weight_sync", "SGLang servers load weights from disk or a broadcast, "
                         "not from this node's shared memory; use disk, distributed or auto"))
        if self.demo.sft_tool_fraction > 0 and self.rollout.tool == "none":
            errs.append(("demo.sft_tool_fraction", f"{self.demo.sft_tool_fraction} teaches tool calls, but "
                         "rollout.tool is none: set rollout.tool=python (and a tokenizer with the call "
                         "tokens, e.g. model.tokenizer=builtin:demo-tools)"))
        if self.learner.mismatch_every and not self.algo.computes_proximal:
            errs.append(("learner.mismatch_every", f"{self.learner.mismatch_every} compares the engine's log-probs "
                         "with the learner's, which this loss does not compute (algo.recompute_proximal=false): "
                         "set algo.recompute_proximal=true or learner.mismatch_every=0"))
        return errs
