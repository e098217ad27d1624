"""Weight publication: the learner's parameters as full Hugging Face-named tensors.

What it is: `iter_hf_buckets` walks every parameter of the model across the PP stages (in
stage order), gathers its TP shards, un-shards and renames it with the `checkpoint_tools`
adapter (the same mapping HF loading uses) and yields size-bounded buckets on every rank;
`save_hf_weights` writes them as a sharded safetensors HF folder (with config.json and the
tokenizer files of the source folder) atomically; `init_custom_group` makes the process group
that engines join for SGLang's distributed weight update (`weight_sender.py` drives it).
What it is not: the engine-side HTTP calls (rollout/) or the Megatron checkpoint (checkpoint.py).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_darl.learner.collectives import all_gather_json
from megatron_darl.learner.model import chunk_layer_offset, global_name

_COPY_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")
_OUTPUT = "output_layer.weight"


def _local_params(chunks: list) -> list[tuple[str, torch.Tensor]]:
    out = []
    for chunk in chunks:
        offset = chunk_layer_offset(chunk)
        out += [(global_name(n, offset), p) for n, p in chunk.named_parameters()]
    return out


def _gather_tp(adapter, name: str, param: torch.Tensor, tp_group) -> torch.Tensor:
    tp = dist.get_world_size(tp_group)
    if tp == 1:
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
    return adapter.unshard(name, shards)


def iter_hf_buckets(chunks: list, adapter, ctx, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (hf_name, full tensor) covering the whole model once; every rank gets them."""
    local = _local_params(chunks)
    by_stage = all_gather_json([n for n, _ in local], ctx.pg.pp, ctx.device)  # names per PP stage
    mine = dict(local)
    dtype = local[0][1].dtype
    bucket, size = [], 0
    for stage, names in enumerate(by_stage):
        src = dist.get_global_rank(ctx.pg.pp, stage)
        for name in names:
            if name == _OUTPUT and adapter.tied:
                continue  # Megatron's copy of the tied embedding: HF stores it once
            if stage == ctx.pp_rank:
                full = _gather_tp(adapter, name, mine[name], ctx.pg.tp)
            else:
                full = torch.empty(adapter.shape(name, ctx.tp), dtype=dtype, device=ctx.device)
            if ctx.pp > 1:
                dist.broadcast(full, src=src, group=ctx.pg.pp)
            for hf_name, t in adapter.to_hf(name, full):
                bucket.append((hf_name, t.contiguous()))
                size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket


def save_hf_weights(chunks: list, adapter, ctx, out_dir: str, side_dirs: list[str],
                    bucket_bytes: int = 1 << 30) -> None:
    """Write an HF folder at `out_dir` (see `write_hf_folder`). Collective; rank 0 writes."""
    buckets = iter_hf_buckets(chunks, adapter, ctx, bucket_bytes)
    if dist.get_rank() == 0:
        write_hf_folder(buckets, out_dir, hf_config(adapter, chunks), side_dirs)
    else:
        for _ in buckets:  # the gathers are collective
            pass
    dist.barrier()


def hf_config(adapter, chunks: list) -> dict:
    """The adapter's HF config.json with the dtype set to the exported one."""
    config = dict(adapter.hf_config)
    dtype = str(chunks[0].config.params_dtype).replace("torch.", "")
    config.update({k: dtype for k in ("torch_dtype", "dtype") if k in config} or {"torch_dtype": dtype})
    return config


def write_hf_folder(buckets, out_dir: str, config: dict, side_dirs: list[str]) -> None:
    """One safetensors file per bucket plus the index, `config` as config.json and the
    tokenizer / generation files found in `side_dirs`; built in a temp folder then renamed so a
    reader never sees a half-written folder. Local: no collective."""
    from safetensors.torch import save_file

    tmp = f"{out_dir.rstrip('/')}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weight_map: dict[str, str] = {}
    total = 0
    for i, bucket in enumerate(buckets):
        fname = f"model-{i + 1:05d}.safetensors"
        save_file({n: t.cpu() for n, t in bucket}, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _ in bucket})
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    for name in _COPY_FILES:
        for src in side_dirs:
            if os.path.isfile(os.path.join(src, name)) and not os.path.exists(os.path.join(tmp, name)):
                shutil.copy(os.path.join(src, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    replace_folder(tmp, out_dir)


def replace_folder(tmp: str, dest: str) -> None:
    """Put the finished folder `tmp` at `dest`; a reader sees the old or the new folder whole."""
    old = f"{dest.rstrip('/')}.old"
    if os.path.exists(dest):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def describe(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    """`names`, `dtypes`, `shapes` of a bucket as SGLang's /update_weights_from_distributed takes them."""
    return {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


