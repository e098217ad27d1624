"""Hugging Face checkpoint folders: lazy safetensors reading and size-capped sharded writing.

What it is: `HFReader` opens `model.safetensors` or a `model.safetensors.index.json` shard set and
returns one tensor at a time (safetensors `safe_open`, nothing else is loaded); `HFShardWriter`
writes `model-0000i-of-0000n.safetensors` files no larger than a cap plus the index;
`copy_side_files` carries tokenizer and generation-config files across.
What it is not: a model loader, and it does not read `pytorch_model.bin` checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoint_tools.api import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files a tokenizer / generation setup may need; copied verbatim when present.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir!r} is not a Hugging Face model folder: config.json is missing")
    with open(path) as f:
        return json.load(f)


class HFReader:
    """Lazy tensor access by HF name across the folder's safetensors files."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index_path, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                self.weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise CheckpointError(f"{hf_dir!r} has neither {INDEX_FILE} nor {SINGLE_FILE} (only safetensors is read)")
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.hf_dir}: tensor {name!r} is not in the checkpoint")
        fname = self.weight_map[name]
        if fname not in self._handles:
            path = os.path.join(self.hf_dir, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{INDEX_FILE} names {fname!r} for {name!r} but the file is missing")
            self._handles[fname] = safe_open(path, framework="pt")
        return self._handles[fname].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for u, mult in units.items():
        if t.endswith(u) and t[: -len(u)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(u)]) * mult)
    if t.isdigit():
        return int(t)
    raise CheckpointError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB or a byte count")


class HFShardWriter:
    """Buffers tensors and flushes a safetensors shard whenever the next tensor would pass the cap."""

    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()  # storages referenced by the buffer, to spot shared ones
        self._buf_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        t = tensor.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._storages:
            t = t.clone()  # gate/up views of one fc1: safetensors refuses tensors sharing storage in a file
        self._storages.add(t.untyped_storage().data_ptr())
        self._buf[name] = t
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        idx = len(self._shards)
        save_file(self._buf, os.path.join(self.out_dir, f"_shard{idx}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._buf))
        self._buf, self._buf_bytes, self._storages = {}, 0, set()

    def finish(self) -> list[str]:
        """Write the last shard, give shards their final `-of-` names and the index (always written,
        even for one shard); the shard file names."""
        if self._buf or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map, files = {}, []
        for i, names in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f"_shard{i}.tmp"), os.path.join(self.out_dir, fname))
            weight_map.update({k: fname for k in names})
            files.append(fname)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
        return files


def copy_side_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """Copy tokenizer / generation-config files present in `src_dir`; the names copied."""
    if not src_dir or not os.path.isdir(src_dir):
        return []
    copied = []
    for name in SIDE_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied
