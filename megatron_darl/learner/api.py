"""Learner role: the `Learner` protocol the trainer drives.

What it is: the contract between the trainer's loop and the Megatron-Core learner: the methods
the loop, the publisher and the checkpointer call (recompute, train step, weight export,
checkpoint). Its settings are the `model`, `parallel`, `optim` and `learner` config sections
(`config/learner.py`) and the `algo` section (`algo/config.py`).
What it is not: any Megatron code; that lives in `model.py`, `parallel.py`, `train_step.py`,
`megatron_learner.py`. Importing this module never imports torch or Megatron.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np

from megatron_darl.types import TrainBatch


@runtime_checkable
class Learner(Protocol):
    """Every call the train loop, the weight publisher and the run checkpointer make (a test
    holds them to it). Every rank of the learner job calls every method in the same order (they
    are collective) and gets the same return values; `is_main` (global rank 0) is the rank that
    owns incoming batches (`broadcast_batch`) and writes files."""

    pmis: str  # D-ARL's beta_k: algo.pmis_beta, or "tokens"
    balance_mode: str | None  # pmis="balance": "exact" (version snapshots) | "interpolate"; else None
    vocab_size: int  # the model's vocabulary: the weight probe draws its token ids below it
    temperature: float  # log-probs are of logits / temperature; the weight probe scores at 1.0

    @property
    def is_main(self) -> bool: ...

    def broadcast_batch(self, batch: TrainBatch | None) -> TrainBatch: ...

    def compute_logprobs(self, batch: TrainBatch) -> np.ndarray: ...

    def compute_version_logprobs(self, batch: TrainBatch, versions: list[int]) -> dict[int, np.ndarray]: ...

    def measures_mismatch(self, step: int) -> bool: ...

    def train_step(self, batch: TrainBatch, beta: dict[int, float] | None = None) -> dict[str, float]: ...

    def export_hf(self, out_dir: str) -> None: ...

    def iter_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]: ...

    def hf_folder_info(self) -> tuple[dict, list[str]]: ...

    def save(self, ckpt_dir: str, extra_state: dict[str, Any]) -> None: ...

    def load(self, ckpt_dir: str) -> dict[str, Any]: ...

    def close(self, keep_world: bool = False) -> None: ...
