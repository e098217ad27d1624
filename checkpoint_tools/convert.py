"""HF <-> Megatron-Core checkpoint conversion and TP/PP resharding, streamed tensor by tensor.

What it is: the three operations behind `darl-convert` (`hf_to_mcore`, `mcore_to_hf`, `reshard`),
each reading one tensor at a time (safetensors `safe_open`, `torch.load(mmap=True)`) so a model is
never held twice: the peak is one (tp, pp) rank's output file plus one full tensor
(`hf_to_mcore`/`reshard`) or one output safetensors shard plus one tensor (`mcore_to_hf`).
What it is not: the name mapping (`adapters.py`) or the file layouts (`hf_format.py`, `mcore_format.py`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import torch
from tqdm import tqdm

from checkpoint_tools.adapters import (
    EMBED,
    OUTPUT,
    GPTAdapter,
    get_adapter,
    layer_range,
    padded_vocab_size,
    stage_to_hf,
)
from checkpoint_tools.api import CheckpointError, MissingTensorsError, ShapeMismatchError
from checkpoint_tools.hf_format import HFReader, HFShardWriter, copy_side_files, parse_size, read_config
from checkpoint_tools.mcore_format import (
    HF_EXTRA_DIR,
    McoreMeta,
    load_mcore_rank_state,
    rank_dir,
    read_meta,
    save_rank_state,
    write_meta,
)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise CheckpointError(f"--dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prepare_out(out: str, overwrite: bool) -> None:
    """Create an empty output folder; an existing non-empty one needs `overwrite`."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        if not overwrite:
            raise CheckpointError(f"output {out!r} already exists; pass --overwrite to replace it")
        shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    os.makedirs(out, exist_ok=True)


def check_layout(adapter: GPTAdapter, tp: int, pp: int) -> None:
    """Fail before writing anything if (tp, pp) cannot hold this model: shard meta tensors."""
    if tp < 1 or pp < 1:
        raise CheckpointError(f"tp={tp} and pp={pp} must be >= 1")
    layer_range(0, pp, adapter.num_layers)
    for name in adapter.stage_names(0, 1):
        adapter.shard(name, torch.empty(adapter.shape(name, tp), device="meta"), 0, tp)


def _shard_shape(adapter: GPTAdapter, name: str, tp: int) -> tuple[int, ...]:
    return tuple(adapter.shard(name, torch.empty(adapter.shape(name, tp), device="meta"), 0, tp).shape)


def _write_stage(root: str, adapter: GPTAdapter, tp: int, pp_rank: int, pp: int,
                 full_of: Callable[[str], torch.Tensor], bar: tqdm) -> None:
    """Write one pipeline stage's tp rank files, one rank at a time: the full tensors are rebuilt
    per rank (cheap lazy reads) so memory holds one rank's shard of the stage, not all of them."""
    for r in range(tp):
        state: dict = {}
        for name in adapter.stage_names(pp_rank, pp):
            full = full_of(name)
            # clone: own storage, or torch.save would write all of `full` for a view of it
            state[adapter.to_local_name(name, pp_rank, pp)] = adapter.shard(name, full, r, tp).clone()
            del full
            bar.update(1)
        state.update({k: None for k in adapter.extra_state_keys(pp_rank, pp)})  # Megatron local linears' value
        save_rank_state(root, r, pp_rank, pp, state)
        del state


def _total(adapter: GPTAdapter, tp: int, pp: int) -> int:
    return tp * sum(len(adapter.stage_names(p, pp)) for p in range(pp))


def hf_to_mcore(hf_dir: str, out: str, tp: int = 1, pp: int = 1, dtype: str | None = None, spec: str = "local",
                make_vocab_size_divisible_by: int = 128, overwrite: bool = False, progress: bool = True) -> McoreMeta:
    """Convert an HF safetensors folder to Megatron-LM per-rank files (see `mcore_format.py`).

    Args:
        hf_dir: the HF model folder (config.json, safetensors, tokenizer files).
        out: the output folder, created empty (see `overwrite`).
        tp: tensor-parallel size of the output, >= 1 (1: unsharded).
        pp: pipeline-parallel size of the output, >= 1; the layers split evenly across stages.
        dtype: cast every tensor to this (`bf16`, `fp16`, `fp32` or their long names);
            None keeps the source's dtype.
        spec: Megatron layer spec the names follow: `local` (CPU modules) or `te` (Transformer Engine).
        make_vocab_size_divisible_by: the vocab rows are padded to a multiple of this times `tp`.
        overwrite: replace an existing non-empty `out`; False raises instead.
        progress: show a tqdm bar, one tick per tensor written.
    """
    adapter = get_adapter(read_config(hf_dir), spec, make_vocab_size_divisible_by)
    check_layout(adapter, tp, pp)
    reader = HFReader(hf_dir)
    missing = set(adapter.hf_shapes()) - reader.names()
    if missing:
        raise MissingTensorsError(f"HF checkpoint {hf_dir}", sorted(missing))
    to_dtype = parse_dtype(dtype)
    saved_dtype = to_dtype or reader.get("model.embed_tokens.weight").dtype
    prepare_out(out, overwrite)

    def full_of(name: str) -> torch.Tensor:
        t = adapter.from_hf(name, reader.get, tp)
        return t.to(to_dtype) if to_dtype is not None else t

    with tqdm(total=_total(adapter, tp, pp), desc="hf-to-mcore", unit="tensor", disable=not progress) as bar:
        for pp_rank in range(pp):
            _write_stage(out, adapter, tp, pp_rank, pp, full_of, bar)
    reader.close()
    extra = os.path.join(out, HF_EXTRA_DIR)
    os.makedirs(extra)
    copy_side_files(hf_dir, extra)
    meta = McoreMeta(hf_config=adapter.hf_config, tp=tp, pp=pp, dtype=_dtype_name(saved_dtype), spec=spec,
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                     padded_vocab_size=padded_vocab_size(adapter.vocab_size, tp, make_vocab_size_divisible_by),
                     vocab_size=adapter.vocab_size)
    write_meta(out, meta)
    return meta


class _StageSource:
    """Lazily loaded (mmap) rank files of a source checkpoint, gathered back into full tensors."""

    def __init__(self, root: str, meta: McoreMeta, adapter: GPTAdapter):
        self.root, self.meta, self.adapter = root, meta, adapter
        self._states: dict[int, list[dict]] = {}

    def stage(self, pp_rank: int) -> list[dict]:
        if pp_rank not in self._states:
            self._states = {pp_rank: [load_mcore_rank_state(self.root, r, pp_rank) for r in range(self.meta.tp)]}
            self._check(pp_rank)
        return self._states[pp_rank]

    def _check(self, pp_rank: int) -> None:
        """Every tensor the stage should hold is present in every rank, with the expected shard shape."""
        a, m = self.adapter, self.meta
        missing = []
        for r, state in enumerate(self._states[pp_rank]):
            where = os.path.basename(rank_dir(self.root, r, pp_rank, m.pp))
            for name in a.stage_names(pp_rank, m.pp):
                local = a.to_local_name(name, pp_rank, m.pp)
                if local not in state:
                    missing.append(f"{where}/{local}")
                    continue
                want = _shard_shape(a, name, m.tp)
                if tuple(state[local].shape) != want:
                    raise ShapeMismatchError(local, want, tuple(state[local].shape), where=where)
        if missing:
            raise MissingTensorsError(f"Megatron checkpoint {self.root}", missing)

    def full(self, name: str) -> torch.Tensor:
        """The full tensor for a global name, from whichever source stage holds it."""
        a, pp = self.adapter, self.meta.pp
        if name == OUTPUT and a.tied and pp == 1:
            name = EMBED  # the source never stored Megatron's last-stage copy; it equals the embedding
        src = 0 if name == EMBED else pp - 1
        if name.startswith("decoder.layers."):
            src = int(name.split(".")[2]) // (a.num_layers // pp)
        states = self.stage(src)
        local = a.to_local_name(name, src, pp)
        return a.unshard(name, [s[local] for s in states])


def _repad(full: torch.Tensor, adapter: GPTAdapter, name: str, tp: int) -> torch.Tensor:
    """Vocab rows padded for the target tp (the padding depends on tp)."""
    if name not in (EMBED, OUTPUT):
        return full
    rows = adapter.shape(name, tp)[0]
    body = full[: adapter.vocab_size]
    return (torch.cat([body, body.new_zeros((rows - body.shape[0],) + tuple(body.shape[1:]))])
            if rows > body.shape[0] else body)


def reshard(mcore_dir: str, out: str, tp: int, pp: int, overwrite: bool = False, progress: bool = True) -> McoreMeta:
    """Rewrite a converted Megatron checkpoint for another (tp, pp) layout."""
    meta = read_meta(mcore_dir)
    adapter = get_adapter(meta.hf_config, meta.spec, meta.make_vocab_size_divisible_by)
    check_layout(adapter, tp, pp)
    if os.path.abspath(out) == os.path.abspath(mcore_dir):
        raise CheckpointError("reshard --out must differ from --mcore-dir (the source is read while writing)")
    prepare_out(out, overwrite)
    source = _StageSource(mcore_dir, meta, adapter)
    with tqdm(total=_total(adapter, tp, pp), desc="reshard", unit="tensor", disable=not progress) as bar:
        for pp_rank in range(pp):
            _write_stage(out, adapter, tp, pp_rank, pp, lambda n: _repad(source.full(n), adapter, n, tp), bar)
    src_extra = os.path.join(mcore_dir, HF_EXTRA_DIR)
    os.makedirs(os.path.join(out, HF_EXTRA_DIR))
    copy_side_files(src_extra, os.path.join(out, HF_EXTRA_DIR))
    new = McoreMeta(**{**meta.__dict__, "tp": tp, "pp": pp,
                       "padded_vocab_size": padded_vocab_size(adapter.vocab_size, tp,
                                                              meta.make_vocab_size_divisible_by)})
    write_meta(out, new)
    return new


def _hf_config_out(adapter: GPTAdapter, dtype_name: str) -> dict:
    cfg = dict(adapter.hf_config)
    cfg["architectures"] = [adapter.family.architecture]
    cfg["model_type"] = adapter.family.model_type
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
    for k in keys:
        cfg[k] = dtype_name
    return cfg


def _generation_config(cfg: dict) -> dict:
    """Minimal generation_config.json when the source had none (token ids from config.json)."""
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}


def mcore_to_hf(mcore_dir: str, out: str, tokenizer_dir: str | None = None, dtype: str | None = None,
                max_shard_size: str = "2GB", overwrite: bool = False, progress: bool = True) -> list[str]:
    """Export a converted Megatron checkpoint as an HF folder; returns the safetensors file names.

    Args:
        mcore_dir: a checkpoint written by `hf_to_mcore` or `reshard` (any tp, pp).
        out: the output HF folder, created empty (see `overwrite`).
        tokenizer_dir: a folder whose tokenizer/generation-config files override the copies carried
            in the checkpoint; None uses the carried copies only.
        dtype: cast every tensor to this (`bf16`, `fp16`, `fp32` or long names); None keeps the saved dtype.
        max_shard_size: the cap per safetensors file, e.g. `2GB`, `500MB`, `2GiB` or a byte count.
        overwrite: replace an existing non-empty `out`; False raises instead.
        progress: show a tqdm bar, one tick per HF tensor written.
    """
    meta = read_meta(mcore_dir)
    adapter = get_adapter(meta.hf_config, meta.spec, meta.make_vocab_size_divisible_by)
    to_dtype, cap = parse_dtype(dtype), parse_size(max_shard_size)
    if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
        raise CheckpointError(f"--tokenizer-dir {tokenizer_dir!r} is not a folder")
    prepare_out(out, overwrite)
    source, writer = _StageSource(mcore_dir, meta, adapter), HFShardWriter(out, cap)
    total = len(adapter.hf_shapes())
    with tqdm(total=total, desc="mcore-to-hf", unit="hf tensor", disable=not progress) as bar:
        for pp_rank in range(meta.pp):
            for hf_name, t in stage_to_hf(adapter, source.stage(pp_rank), pp_rank, meta.pp):
                writer.add(hf_name, t.to(to_dtype) if to_dtype is not None else t)
                bar.update(1)
    files = writer.finish()
    cfg = _hf_config_out(adapter, _dtype_name(to_dtype) if to_dtype is not None else meta.dtype)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    copy_side_files(os.path.join(mcore_dir, HF_EXTRA_DIR), out)
    copy_side_files(tokenizer_dir, out)  # an explicit tokenizer folder wins over the carried copy
    if not os.path.isfile(os.path.join(out, "generation_config.json")):
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump(_generation_config(cfg), f, indent=2)
    return files
