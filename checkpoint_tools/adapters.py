"""The one HF <-> Megatron-Core name/layout table for dense GPT-family decoders (Qwen3, Qwen2, Llama).

What it is: `get_adapter(hf_config)` returns a `GPTAdapter` that names, shapes, fuses and
TP-shards every tensor of a Megatron-Core `GPTModel` built with the local or TE layer spec;
used both by `darl-convert` and by the learner's weight export, so the two cannot drift.
What it is not: file I/O (see `hf_format.py`, `mcore_format.py`) or a model builder.

Layouts (checked against megatron-core 0.16.1 `get_gpt_layer_local_spec(qk_layernorm=True)`):
- linear_qkv rows are grouped per KV head: [q for the group's heads; k; v] repeated per group,
  so a TP shard is a contiguous run of whole groups (needs num_kv_heads % tp == 0).
- linear_fc1 = cat([gate, up]); TP rank r holds cat([gate_r, up_r]), not a plain chunk.
- embedding / output rows: vocab padded with zero rows to a multiple of divisible_by * tp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from checkpoint_tools.api import (
    SPECS,
    CheckpointError,
    MissingTensorsError,
    ModelAdapter,
    ShapeMismatchError,
    UnsupportedArchitectureError,
)


@dataclass(frozen=True)
class ArchFamily:
    """What distinguishes one supported HF architecture from the others in the table."""

    architecture: str  # config.json architectures[0]
    model_type: str  # config.json model_type
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    qkv_bias: bool  # biases on q/k/v projections (Qwen2)


FAMILIES = (
    ArchFamily("Qwen3ForCausalLM", "qwen3", qk_norm=True, qkv_bias=False),
    ArchFamily("Qwen2ForCausalLM", "qwen2", qk_norm=False, qkv_bias=True),
    ArchFamily("LlamaForCausalLM", "llama", qk_norm=False, qkv_bias=False),
)

EMBED, FINAL_NORM, OUTPUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron modules with an `_extra_state` entry in the local spec (ColumnParallel/RowParallelLinear)
_LOCAL_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: round up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def layer_range(pp_rank: int, pp_size: int, num_layers: int) -> range:
    """Global layer indices on pipeline stage `pp_rank` (even split, as Megatron's default)."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise CheckpointError(f"pp_rank={pp_rank} is outside 0..{pp_size - 1} (pp_size={pp_size})")
    if num_layers % pp_size:
        raise CheckpointError(
            f"num_layers={num_layers} is not divisible by pp_size={pp_size}; only even pipeline splits are supported"
        )
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def family_of(hf_config: dict) -> ArchFamily:
    """The supported family of an HF config.json dict (architectures[0], else model_type)."""
    archs = hf_config.get("architectures") or []
    arch, model_type = (archs[0] if archs else None), hf_config.get("model_type")
    for fam in FAMILIES:
        if arch == fam.architecture or (arch is None and model_type == fam.model_type):
            return fam
    supported = ", ".join(f"{f.architecture} (model_type {f.model_type})" for f in FAMILIES)
    raise UnsupportedArchitectureError(
        f"config.json architectures={archs!r} model_type={model_type!r} is not supported; supported: {supported}"
    )


def get_adapter(hf_config: dict, spec: str = "local", make_vocab_size_divisible_by: int = 128) -> "GPTAdapter":
    """The adapter for an HF config.json dict (architectures[0] or, if absent, model_type)."""
    return GPTAdapter(hf_config, family_of(hf_config), spec, make_vocab_size_divisible_by)


class GPTAdapter(ModelAdapter):
    """Table-driven mapping for the dense decoder families in `FAMILIES`."""

    def __init__(self, hf_config: dict, family: ArchFamily, spec: str, make_vocab_size_divisible_by: int):
        if spec not in SPECS:
            raise CheckpointError(f"spec={spec!r} is not one of {SPECS}")
        self.hf_config, self.family, self.spec = dict(hf_config), family, spec
        self.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        c = hf_config
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if not isinstance(c.get(key), int):
                raise CheckpointError(f"config.json field {key!r} must be an int, got {c.get(key)!r}")
        for key in ("attention_bias", "mlp_bias"):
            if c.get(key) and not (key == "attention_bias" and family.qkv_bias):
                raise CheckpointError(f"config.json {key}=true is not supported for {family.architecture}")
        self.hidden, self.num_layers = c["hidden_size"], c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.ffn, self.vocab_size = c["intermediate_size"], c["vocab_size"]
        self.tied = bool(c.get("tie_word_embeddings", False))
        if self.heads % self.kv_heads:
            raise CheckpointError(f"num_attention_heads={self.heads} not divisible by "
                                  f"num_key_value_heads={self.kv_heads}")
        self._rules = self._layer_rules()

    # ---- the table: mcore layer suffix -> (kind, HF suffixes, TP split) ----
    def _layer_rules(self) -> dict[str, tuple[str, tuple[str, ...], str]]:
        a = "self_attn."
        in_norm = "self_attention.linear_qkv.layer_norm_weight" if self.spec == "te" else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if self.spec == "te" else "pre_mlp_layernorm.weight"
        rules = {
            in_norm: ("copy", ("input_layernorm.weight",), "replicated"),
            "self_attention.linear_qkv.weight": ("qkv", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                                                 "dim0"),
            "self_attention.linear_proj.weight": ("copy", (a + "o_proj.weight",), "dim1"),
            mlp_norm: ("copy", ("post_attention_layernorm.weight",), "replicated"),
            "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
            "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",), "dim1"),
        }
        if self.family.qk_norm:
            rules["self_attention.q_layernorm.weight"] = ("copy", (a + "q_norm.weight",), "replicated")
            rules["self_attention.k_layernorm.weight"] = ("copy", (a + "k_norm.weight",), "replicated")
        if self.family.qkv_bias:
            rules["self_attention.linear_qkv.bias"] = ("qkv", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                                                       "dim0")
        return rules

    def _rule(self, mcore_name: str) -> tuple[str, tuple[str, ...], str]:
        """(kind, full HF names, TP split) for any global mcore name."""
        vocab_hf = "model.embed_tokens.weight" if (mcore_name == EMBED or self.tied) else "lm_head.weight"
        if mcore_name in (EMBED, OUTPUT):
            return "vocab", (vocab_hf,), "dim0"
        if mcore_name == FINAL_NORM:
            return "copy", ("model.norm.weight",), "replicated"
        m = _LAYER_RE.match(mcore_name)
        if m and m.group(2) in self._rules and int(m.group(1)) < self.num_layers:
            kind, hf, split = self._rules[m.group(2)]
            return kind, tuple(f"model.layers.{m.group(1)}.{h}" for h in hf), split
        raise CheckpointError(f"{mcore_name!r} is not a {self.family.architecture} mcore name (spec={self.spec})")

    # ---- shapes ----
    def _hf_shape(self, hf_name: str) -> tuple[int, ...]:
        h, d = self.hidden, self.head_dim
        if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return (self.vocab_size, h)
        sfx = hf_name.rsplit(".", 2)[-2] + "." + hf_name.rsplit(".", 1)[-1]
        rows = {"q_proj": self.heads * d, "k_proj": self.kv_heads * d, "v_proj": self.kv_heads * d}
        if sfx.split(".")[0] in rows:
            r = rows[sfx.split(".")[0]]
            return (r,) if sfx.endswith("bias") else (r, h)
        table = {"o_proj.weight": (h, self.heads * d), "q_norm.weight": (d,), "k_norm.weight": (d,),
                 "gate_proj.weight": (self.ffn, h), "up_proj.weight": (self.ffn, h), "down_proj.weight": (h, self.ffn)}
        return table.get(sfx, (h,))  # everything else is a hidden-size RMSNorm weight

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        names = [n for m in self.mcore_shapes() for n in self._rule(m)[1]]
        return {n: self._hf_shape(n) for n in dict.fromkeys(names)}

    def shape(self, mcore_name: str, tp_size: int = 1) -> tuple[int, ...]:
        kind, hf, _ = self._rule(mcore_name)
        if kind == "vocab":
            return (padded_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by), self.hidden)
        parts = [self._hf_shape(n) for n in hf]
        return (sum(p[0] for p in parts),) + parts[0][1:] if kind in ("qkv", "fc1") else parts[0]

    def tp_split(self, mcore_name: str) -> str:
        """How tensor parallelism splits a tensor: replicated | dim0 | dim1 | fc1 (gate/up halves)."""
        return self._rule(mcore_name)[2]

    def rank_numel(self, pp_rank: int, pp_size: int, tp_size: int) -> int:
        """Parameters held by one rank of stage `pp_rank` (its TP shard; replicated norms whole):
        what Megatron allocates there, the tied output copy on the last stage included."""
        total = 0
        for name in self.stage_names(pp_rank, pp_size):
            n = 1
            for dim in self.shape(name, tp_size):
                n *= dim
            total += n if self.tp_split(name) == "replicated" else n // tp_size
        return total

    def mcore_shapes(self, tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        return {n: self.shape(n, tp_size) for n in self.stage_names(0, 1)}

    # ---- HF <-> mcore ----
    def from_hf(self, mcore_name: str, get_hf: Callable[[str], torch.Tensor], tp_size: int = 1) -> torch.Tensor:
        kind, hf_names, _ = self._rule(mcore_name)
        parts = []
        for n in hf_names:
            t = get_hf(n)
            if tuple(t.shape) != self._hf_shape(n):
                raise ShapeMismatchError(n, self._hf_shape(n), tuple(t.shape), where="HF checkpoint")
            parts.append(t)
        if kind == "copy":
            return parts[0]
        if kind == "fc1":
            return torch.cat(parts, dim=0)
        if kind == "vocab":
            rows = self.shape(mcore_name, tp_size)[0] - self.vocab_size
            return torch.cat([parts[0], parts[0].new_zeros((rows,) + tuple(parts[0].shape[1:]))]) if rows else parts[0]
        q, k, v = (p.reshape((self.kv_heads, -1) + tuple(p.shape[1:])) for p in parts)  # per KV group
        return torch.cat([q, k, v], dim=1).reshape((-1,) + tuple(parts[0].shape[1:]))

    def to_hf(self, mcore_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        kind, hf_names, _ = self._rule(mcore_name)
        if mcore_name == OUTPUT and self.tied:
            return []  # Megatron's last-stage copy of the tied embedding; HF stores it once
        if kind == "copy":
            return [(hf_names[0], full)]
        if kind == "vocab":
            return [(hf_names[0], full[: self.vocab_size])]
        if kind == "fc1":
            return list(zip(hf_names, full.split(self.ffn, dim=0)))
        per_group = full.reshape((self.kv_heads, -1) + tuple(full.shape[1:]))
        q_rows = self.heads // self.kv_heads * self.head_dim
        q, k, v = per_group.split([q_rows, self.head_dim, self.head_dim], dim=1)
        return [(n, t.reshape((-1,) + tuple(full.shape[1:]))) for n, t in zip(hf_names, (q, k, v))]

    # ---- tensor parallel ----
    def _check_tp(self, mcore_name: str, split: str, rows: int, tp_size: int) -> None:
        if split in ("dim0", "fc1") and "linear_qkv" in mcore_name and self.kv_heads % tp_size:
            raise CheckpointError(
                f"tp={tp_size} must divide num_key_value_heads={self.kv_heads} (linear_qkv is split by query group)"
            )
        if rows % tp_size:
            raise CheckpointError(f"{mcore_name!r}: dimension {rows} is not divisible by tp={tp_size}")

    def shard(self, mcore_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        _, _, split = self._rule(mcore_name)
        if not 0 <= tp_rank < tp_size:
            raise CheckpointError(f"tp_rank={tp_rank} is outside 0..{tp_size - 1}")
        if split == "replicated":
            return full
        dim = 1 if split == "dim1" else 0
        self._check_tp(mcore_name, split, full.shape[dim], tp_size)
        if split == "fc1":
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)
        return full.chunk(tp_size, dim=dim)[tp_rank].contiguous()

    def unshard(self, mcore_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        _, _, split = self._rule(mcore_name)
        if split == "replicated":
            return shards[0]
        if split == "fc1":
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=1 if split == "dim1" else 0)

    # ---- pipeline parallel ----
    def stage_names(self, pp_rank: int, pp_size: int) -> list[str]:
        names = [EMBED] if pp_rank == 0 else []
        for i in layer_range(pp_rank, pp_size, self.num_layers):
            names += [f"decoder.layers.{i}.{sfx}" for sfx in self._rules]
        if pp_rank == pp_size - 1:
            names.append(FINAL_NORM)
            if not self.tied or pp_size > 1:  # tied + pp>1: Megatron keeps a copy as output_layer.weight
                names.append(OUTPUT)
        return names

    def extra_state_keys(self, pp_rank: int, pp_size: int) -> list[str]:
        if self.spec != "local":
            return []
        n = len(layer_range(pp_rank, pp_size, self.num_layers))
        keys = [f"decoder.layers.{i}.{m}._extra_state" for i in range(n) for m in _LOCAL_LINEARS]
        return keys + (["output_layer._extra_state"] if pp_rank == pp_size - 1 else [])

    def _renumber(self, name: str, pp_rank: int, pp_size: int, to_local: bool) -> str:
        m = _LAYER_RE.match(name)
        if not m:
            return name
        rng = layer_range(pp_rank, pp_size, self.num_layers)
        i = int(m.group(1))
        j = i - rng.start if to_local else i + rng.start
        if not (i in rng if to_local else 0 <= i < len(rng)):
            side = "global" if to_local else "local"
            raise CheckpointError(f"{side} layer {i} of {name!r} is not on pipeline stage {pp_rank} ({rng})")
        return f"decoder.layers.{j}.{m.group(2)}"

    def to_local_name(self, mcore_name: str, pp_rank: int, pp_size: int) -> str:
        return self._renumber(mcore_name, pp_rank, pp_size, to_local=True)

    def to_global_name(self, local_name: str, pp_rank: int, pp_size: int) -> str:
        return self._renumber(local_name, pp_rank, pp_size, to_local=False)


def stage_from_hf(adapter: ModelAdapter, get_hf: Callable[[str], torch.Tensor], tp_rank: int, tp_size: int,
                  pp_rank: int, pp_size: int) -> dict[str, torch.Tensor | None]:
    """One rank's Megatron state dict (local names, TP shard, `_extra_state` None where the spec
    expects it) straight from HF tensors, e.g. `HFReader(dir).get`: a learner can start from an
    HF folder without a converted copy."""
    state: dict[str, torch.Tensor | None] = {}
    for name in adapter.stage_names(pp_rank, pp_size):
        full = adapter.from_hf(name, get_hf, tp_size)
        state[adapter.to_local_name(name, pp_rank, pp_size)] = adapter.shard(name, full, tp_rank, tp_size).clone()
    state.update({k: None for k in adapter.extra_state_keys(pp_rank, pp_size)})
    return state


def stage_to_hf(adapter: ModelAdapter, tp_states: list[dict], pp_rank: int,
                pp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, full tensor) pairs of one pipeline stage, from every TP rank's local state dict
    (rank order); one tensor at a time, for weight export. The tied last-stage output copy is skipped."""
    names = adapter.stage_names(pp_rank, pp_size)
    locals_ = [adapter.to_local_name(n, pp_rank, pp_size) for n in names]
    missing = [f"tp_rank {r}: {ln}" for r, s in enumerate(tp_states) for ln in locals_ if ln not in s]
    if missing:
        raise MissingTensorsError(f"pipeline stage {pp_rank}", missing)
    for name, local in zip(names, locals_):
        if name == OUTPUT and adapter.tied:
            continue
        yield from adapter.to_hf(name, adapter.unshard(name, [s[local] for s in tp_states]))
