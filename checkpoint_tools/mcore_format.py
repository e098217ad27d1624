"""Megatron-LM legacy per-rank checkpoint folders: naming, metadata, save and lazy load.

What it is: the on-disk layout `darl-convert` writes and the learner reads:
`<dir>/mp_rank_{tp:02d}/model_optim_rng.pt` (pp=1) or `<dir>/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt`,
each `{"model": <stage state dict, local layer numbers, TP shard>, "checkpoint_version": 3.0}`,
plus `<dir>/darl_meta.json` (HF config, tp, pp, dtype, vocab padding, spec).
What it is not: Megatron's distributed (torch_dist) checkpoint format, and it holds no optimizer state.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from checkpoint_tools.api import CheckpointError

META_FILE = "darl_meta.json"
RANK_FILE = "model_optim_rng.pt"
HF_EXTRA_DIR = "hf_extra"  # tokenizer and generation_config files carried through from the HF source
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current legacy-checkpoint version


@dataclass
class McoreMeta:
    """What a reader needs to rebuild the model and undo the layout (written as darl_meta.json)."""

    hf_config: dict  # the HF config.json the checkpoint was converted from
    tp: int  # tensor-parallel size of the shards
    pp: int  # pipeline-parallel size of the stages
    dtype: str  # torch dtype name of the saved tensors, e.g. "bfloat16"
    spec: str  # Megatron layer spec the names follow: "local" | "te"
    make_vocab_size_divisible_by: int  # Megatron padding multiple (times tp)
    padded_vocab_size: int  # embedding / output rows in the checkpoint
    vocab_size: int  # true vocabulary size (rows past it are zero padding)
    format_version: int = 1  # this metadata's own schema version


def rank_dir(root: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's per-rank folder name (`mp_rank_TT` when pp=1, `mp_rank_TT_PPP` otherwise)."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(root, name)


def write_meta(root: str, meta: McoreMeta) -> None:
    with open(os.path.join(root, META_FILE), "w") as f:
        json.dump(asdict(meta), f, indent=2, sort_keys=True)


def read_meta(root: str) -> McoreMeta:
    """The metadata of a converted checkpoint folder, with a clear error if it is not one."""
    path = os.path.join(root, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{root!r} is not a darl Megatron checkpoint: {META_FILE} is missing")
    with open(path) as f:
        raw = json.load(f)
    fields = set(McoreMeta.__dataclass_fields__)
    missing = sorted(k for k in fields if k not in raw and k != "format_version")
    if missing:
        raise CheckpointError(f"{path}: missing field(s) {missing}")
    return McoreMeta(**{k: v for k, v in raw.items() if k in fields})


def save_rank_state(root: str, tp_rank: int, pp_rank: int, pp_size: int, model_state: dict) -> str:
    d = rank_dir(root, tp_rank, pp_rank, pp_size)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, RANK_FILE)
    torch.save({"model": model_state, "checkpoint_version": CHECKPOINT_VERSION}, path)
    return path


def load_mcore_rank_state(root: str, tp_rank: int, pp_rank: int, mmap: bool = True) -> dict:
    """The `model` state dict of one rank (local layer names, TP shard, `_extra_state` None for the
    local spec so `GPTModel.load_state_dict(strict=True)` works). mmap=True reads tensors lazily."""
    meta = read_meta(root)
    if not (0 <= tp_rank < meta.tp and 0 <= pp_rank < meta.pp):
        raise CheckpointError(f"rank tp={tp_rank} pp={pp_rank} is outside the checkpoint's tp={meta.tp} pp={meta.pp}")
    path = os.path.join(rank_dir(root, tp_rank, pp_rank, meta.pp), RANK_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"rank file {path} is missing")
    blob = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    if "model" not in blob:
        raise CheckpointError(f"{path} has no 'model' entry (keys: {sorted(blob)})")
    return blob["model"]
