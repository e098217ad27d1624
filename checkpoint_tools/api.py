"""Checkpoint tools API: the model-adapter protocol and the errors conversion raises.

What it is: the contract between one architecture's name/layout mapping (`adapters.py`) and its
two users, the offline converter (`convert.py`, `darl-convert`) and the learner's weight export.
Modelled on torchtitan's `BaseStateDictAdapter` (`to_hf` / `from_hf`), extended with the
tensor-parallel (`shard` / `unshard`) and pipeline-parallel (`stage_names`, `to_local_name`)
layout of a Megatron-Core `GPTModel`.
What it is not: file I/O or a Megatron model builder; it only names, shapes and reorders tensors.

Naming: "mcore names" are full `GPTModel.state_dict()` keys with GLOBAL layer numbers
(`decoder.layers.{i}.…`); a pipeline stage's own state dict numbers its layers from 0 (local names).
Vocab padding: Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by * tp`;
the padded rows are zeros on the way in (`from_hf`) and dropped on the way out (`to_hf`), so
logits past `vocab_size` are meaningless and the learner must slice them off before a softmax.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

SPECS = ("local", "te")  # Megatron layer specs: local modules (CPU) or Transformer Engine (fused norms)


class CheckpointError(ValueError):
    """Bad input to a conversion (architecture, tensors, shapes, folders)."""


class UnsupportedArchitectureError(CheckpointError):
    """The config names an architecture no adapter handles."""


class MissingTensorsError(CheckpointError):
    """Tensors the mapping needs are absent from a checkpoint; `names` lists them all."""

    def __init__(self, where: str, names: list[str]):
        self.names = sorted(names)
        shown = ", ".join(self.names[:20]) + (f", … ({len(self.names)} in all)" if len(self.names) > 20 else "")
        super().__init__(f"{where}: missing {len(self.names)} tensor(s): {shown}")


class ShapeMismatchError(CheckpointError):
    """A tensor's shape is not what the config implies."""

    def __init__(self, name: str, expected: tuple[int, ...], got: tuple[int, ...], where: str = ""):
        self.name, self.expected, self.got = name, tuple(expected), tuple(got)
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}tensor {name!r} has shape {self.got}, expected {self.expected}")


class ModelAdapter(ABC):
    """HF <-> Megatron-Core mapping for one model config, plus its TP/PP layout rules.

    All tensors passed to `to_hf` / returned by `from_hf` are full (unsharded) tensors;
    `shard` / `unshard` convert between a full tensor and its TP pieces.
    """

    hf_config: dict  # the HF config.json contents this adapter was built from
    spec: str  # "local" | "te": which Megatron layer spec names the norms
    num_layers: int  # decoder layers in the whole model
    vocab_size: int  # the HF (unpadded) vocabulary size
    make_vocab_size_divisible_by: int  # Megatron's padding multiple (times tp)
    tied: bool  # tie_word_embeddings: output layer reuses the word embeddings

    @abstractmethod
    def mcore_shapes(self, tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        """Full unsharded `GPTModel` state-dict names (global layers, pp=1) and their shapes;
        embedding/output rows are padded for `tp_size`."""

    @abstractmethod
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The HF tensors the mapping reads (`lm_head.weight` only when untied) and their shapes."""

    @abstractmethod
    def to_hf(self, mcore_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Split one full mcore tensor into its HF tensors (vocab padding removed). The tied
        last-stage `output_layer.weight` copy returns [] (the embedding already carries it)."""

    @abstractmethod
    def from_hf(
        self, mcore_name: str, get_hf: Callable[[str], torch.Tensor], tp_size: int = 1
    ) -> torch.Tensor:
        """Build one full mcore tensor from HF tensors fetched by name (vocab padded for tp_size)."""

    @abstractmethod
    def shard(self, mcore_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """The piece of `full` that TP rank `tp_rank` of `tp_size` holds."""

    @abstractmethod
    def unshard(self, mcore_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard`: the full tensor from all ranks' pieces, in rank order."""

    @abstractmethod
    def stage_names(self, pp_rank: int, pp_size: int) -> list[str]:
        """Global mcore names held by pipeline stage `pp_rank` (tied + pp>1: the last stage
        holds `output_layer.weight`, Megatron's copy of the word embeddings)."""

    @abstractmethod
    def shape(self, mcore_name: str, tp_size: int = 1) -> tuple[int, ...]:
        """Full shape of any name `stage_names` can return."""

    @abstractmethod
    def extra_state_keys(self, pp_rank: int, pp_size: int) -> list[str]:
        """Local `_extra_state` keys the stage's module expects (local spec: one per linear)."""

    @abstractmethod
    def to_local_name(self, mcore_name: str, pp_rank: int, pp_size: int) -> str:
        """Global layer number -> the stage's local one (error if the layer is not on the stage)."""

    @abstractmethod
    def to_global_name(self, local_name: str, pp_rank: int, pp_size: int) -> str:
        """The stage's local layer number -> global one."""
