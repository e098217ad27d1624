"""Weight publication: the learner's parameters as full Hugging Face-named tensors.

What it is: `iter_hf_buckets` walks every parameter of the model across the PP stages (in
stage order), gathers its TP shards, un-shards and renames it with the `checkpoint_tools`
adapter (the same mapping HF loading uses) and yields size-bounded buckets on every rank;
`save_hf_weights` writes them as a sharded safetensors HF folder (with config.json and the
tokenizer files of the source folder) atomically; `NcclWeightBroadcaster` streams the buckets
to SGLang engines joined in an NCCL group (`/update_weights_from_distributed`).
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
    """Write an HF folder at `out_dir`: one safetensors file per bucket plus the index,
    config.json (the adapter's HF config, dtype set to the exported one) and the tokenizer /
    generation files found in `side_dirs`; built in a temp folder then renamed so a reader never
    sees a half-written folder. Collective; rank 0 writes."""
    from safetensors.torch import save_file

    main = dist.get_rank() == 0
    tmp = f"{out_dir.rstrip('/')}.tmp"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    weight_map: dict[str, str] = {}
    total = 0
    for i, bucket in enumerate(iter_hf_buckets(chunks, adapter, ctx, bucket_bytes)):
        if not main:
            continue
        fname = f"model-{i + 1:05d}.safetensors"
        save_file({n: t.cpu() for n, t in bucket}, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _ in bucket})
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    if main:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        for name in _COPY_FILES:
            for src in side_dirs:
                if os.path.isfile(os.path.join(src, name)) and not os.path.exists(os.path.join(tmp, name)):
                    shutil.copy(os.path.join(src, name), os.path.join(tmp, name))
        config = dict(adapter.hf_config)
        dtype = str(chunks[0].config.params_dtype).replace("torch.", "")
        config.update({k: dtype for k in ("torch_dtype", "dtype") if k in config} or {"torch_dtype": dtype})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        replace_folder(tmp, out_dir)
    dist.barrier()


def replace_folder(tmp: str, dest: str) -> None:
    """Put the finished folder `tmp` at `dest`; a reader sees the old or the new folder whole."""
    old = f"{dest.rstrip('/')}.old"
    if os.path.exists(dest):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


class NcclWeightBroadcaster:
    """Streams HF-named tensors from learner rank 0 to SGLang engines over NCCL (GPU clusters).

    The engines join a process group created by SGLang's `/init_weights_update_group`
    (rank 0 = this learner rank, engines 1..n); for each bucket the caller posts
    `/update_weights_from_distributed` with `names`, `dtypes`, `shapes` (from `describe`) and
    then calls `send`, which broadcasts every tensor from rank 0 in that order.
    """

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str = "darl_weights"):
        if not torch.cuda.is_available():
            raise RuntimeError("NcclWeightBroadcaster needs CUDA")
        self.group = init_custom_group(master_address, master_port, world_size, group_name)

    @staticmethod
    def describe(bucket: list[tuple[str, torch.Tensor]]) -> dict:
        return {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket]}

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for _, t in bucket:
            dist.broadcast(t.cuda(), group=self.group, group_src=0)
        torch.cuda.synchronize()


def init_custom_group(master_address: str, master_port: int, world_size: int, group_name: str, rank: int = 0):
    """A second NCCL group beside the default one (the learner's), rendezvous over TCP; the
    learner is rank 0. The construction SGLang's `init_custom_process_group` uses on the engine
    side (receivers call this with their own rank in tests)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store, rank, world = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank=rank, world_size=world_size))
    group, _ = c10d._new_process_group_helper(
        world, rank, [], c10d.Backend("nccl"), c10d.PrefixStore(group_name, store), group_name=group_name,
        timeout=timedelta(minutes=10),
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}  # group rank == rank in this group
    return group
