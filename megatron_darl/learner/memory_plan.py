"""Per-GPU memory plan of a learner recipe: what each rank holds, and whether it fits.

What it is: `plan_run(cfg, hf)` estimates, for the worst pipeline stage of a recipe, the bytes
of parameters, gradients, optimizer states, activations of the micro-batches in flight, the
log-prob head's logits, the forward-only recompute pass, the co-located engines' share and a
runtime allowance; `MemoryPlan.format()` prints it (`darl-train --plan`) and `refusal()` names
the single changes that would make a recipe fit. `learner_checks` refuses a GPU recipe that
does not fit before anything starts.
What it is not: a measurement. Parameter, gradient and optimizer bytes are exact counts of what
Megatron allocates (a test compares them with a real CPU model); activations follow Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4: per layer
sbh(34 + 5as/h) bytes, the replicated 10sbh part divided by t only with sequence parallel),
re-derived for this architecture: no dropout, SwiGLU (fc1 output 2F wide, its product F wide),
GQA (q of a*d, k/v of g*d), q/k RMSNorm, and flash attention (softmax statistics instead of
the a*s^2 score matrix) on the TE spec and on the local spec's default core attention
(`attention.FlashCoreAttention`; `model.attention=dot_product` plans the score matrix).

Formulas, per micro-batch of T tokens, e bytes per activation (2 in bf16), tp t:
- outside the TP region, kept whole unless sequence parallel (then / t): the inputs and outputs
  of the two RMSNorms, 4eTh;
- inside (/ t): q/k before their norms e T (a+g) d (Qwen3), q, k, v e T (a+2g) d, attention
  output e T a d, attention internals 4Ta (flash, fp32 log-sum-exp) or (4 + e) a T min(T, S)
  (dot-product attention, softmax probabilities), fc1 output 2eTF, SwiGLU output eTF (+ eTF for the separate silu
  output without the fused kernel);
- selective recompute drops the internals of the modules it recomputes (core_attn, mlp); full
  recompute keeps only each layer's input eTh (/ t with sequence parallel), plus one layer's
  activations while that layer is re-run in backward;
- with 1F1B pipelining stage k holds pp - k micro-batches of its L/pp layers;
- the head keeps the logits e T V/t for backward, the gradient e T V/t, and fp32 working
  chunks of `logprobs.HEAD_CHUNK_BYTES` (two live at once, one more allowed for conversions).
Bytes per parameter (Megatron-LM docs, "Distributed Optimizer"): bf16 parameters (all of them,
norms included: `model.cast_parameters`) with fp32 main gradients 2 + 4, Adam with fp32 master
weights 12 (sharded over DP by the distributed optimizer: 12 / dp); fp32 parameters 4 + 4 +
Adam 8 (8 / dp). With the distributed optimizer, DDP's parameter and gradient buffers are
padded (`buffer_layout`, megatron-core 0.16.1's rule) and the plan counts them padded; the
optimizer row is the largest DP rank's shard of the parameters' values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

GIB = float(1 << 30)
RESERVE_GIB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation: an allowance, not measured
CHUNK_LIVE = 3  # fp32 chunks alive at once in the head (two, see logprobs.py) plus one for conversions


@dataclass
class Setting:
    """The knobs of a recipe the plan depends on (resolved from RunConfig by `setting_of`)."""

    tp: int
    pp: int
    vpp: int | None
    dp: int
    sequence_parallel: bool
    recompute: str  # none | selective | full
    recompute_modules: tuple[str, ...]
    bf16: bool
    te_spec: bool  # the fused SwiGLU kernel (and TE's flash attention)
    distributed_optimizer: bool
    micro_batch_tokens: int  # the budget, or one sequence longer than it
    recompute_tokens: int  # the forward-only recompute pass's budget
    max_seq: int  # longest sequence (prompt + response)
    multiple: int  # width alignment (FP8 / sequence parallel)
    gpu_gib: float
    engine_fraction: float
    on_gpu: bool
    flash_attention: bool = True  # TE's, or the local spec's FlashCoreAttention (model.attention)


@dataclass
class MemoryPlan:
    setting: Setting
    stage: int  # the pipeline stage that needs the most
    rows: list[tuple[str, float, str]] = field(default_factory=list)  # (what, bytes, how)
    advice: list[str] = field(default_factory=list)  # single changes that fit (filled on refusal)

    @property
    def total(self) -> float:
        return sum(b for _, b, _ in self.rows)

    @property
    def fits(self) -> bool:
        return not self.setting.on_gpu or self.total <= self.setting.gpu_gib * GIB

    def format(self) -> str:
        s = self.setting
        lines = [f"memory plan per GPU (tp={s.tp} pp={s.pp} dp={s.dp} sequence_parallel={s.sequence_parallel} "
                 f"recompute={s.recompute} {'bf16' if s.bf16 else 'fp32'} "
                 f"{'TE spec' if s.te_spec else 'local spec'}, "
                 f"{'flash' if s.flash_attention or s.te_spec else 'dot-product'} attention; "
                 f"worst stage: {self.stage})"]
        lines += [f"  {what:<34} {b / GIB:8.2f} GiB   {how}" for what, b, how in self.rows]
        lines.append(f"  {'total':<34} {self.total / GIB:8.2f} GiB")
        if s.on_gpu:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"  {'GPU memory (learner.gpu_memory_gib)':<34} {s.gpu_gib:8.2f} GiB   {verdict}")
        else:
            lines.append("  CPU run (launch.trainer.gpus_per_node=0): not checked against a GPU")
        return "\n".join(lines)

    def refusal(self) -> str:
        msg = (f"the learner needs {self.total / GIB:.1f} GiB per GPU, more than learner.gpu_memory_gib="
               f"{self.setting.gpu_gib:g} (darl-train --plan prints the breakdown)")
        return msg + ("; each of these fits: " + "; ".join(self.advice) if self.advice else
                      "; no single change fits: lower learner.micro_batch_tokens, raise parallel.tp/pp, "
                      "or use GPUs with more memory")


def _layer_bytes(hf: dict[str, Any], s: Setting, tokens: int, recompute: str) -> tuple[float, float]:
    """(bytes kept per layer until backward, bytes of one layer re-run in backward)."""
    e = 2 if s.bf16 else 4
    h, f = hf["hidden_size"], hf["intermediate_size"]
    a = hf["num_attention_heads"]
    g = hf.get("num_key_value_heads") or a
    d = hf.get("head_dim") or h // a
    sp = s.tp if s.sequence_parallel else 1
    outside = 4 * e * tokens * h / sp
    qk = e * tokens * (a + g) * d if hf.get("model_type", "qwen3") == "qwen3" else 0
    attn = qk + e * tokens * (a + 2 * g) * d + e * tokens * a * d
    # local spec with model.attention=dot_product: megatron-core's DotProductAttention keeps, per
    # score, the fp32 softmax output (attention_softmax_in_fp32, for the softmax backward) and its
    # bf16 copy (for the bmm): 6 B; flash kernels (TE, or torch SDPA in FlashCoreAttention) keep
    # one fp32 log-sum-exp per row and head
    per_score = 4 + (e if s.bf16 else 0)
    flash = s.te_spec or s.flash_attention
    core = 4 * tokens * a if flash else per_score * a * tokens * min(tokens, s.max_seq)
    mlp = e * tokens * f * (3 if s.te_spec else 4)
    whole = outside + (attn + core + mlp) / s.tp
    if recompute == "full":
        return e * tokens * h / sp, whole
    if recompute == "selective":
        return whole - (core / s.tp if "core_attn" in s.recompute_modules else 0) \
                     - (mlp / s.tp if "mlp" in s.recompute_modules else 0), 0.0
    return whole, 0.0


def _head_bytes(hf: dict[str, Any], s: Setting, tokens: int, backward: bool) -> float:
    from checkpoint_tools.adapters import padded_vocab_size
    from megatron_darl.learner.logprobs import HEAD_CHUNK_BYTES

    v_local = padded_vocab_size(hf["vocab_size"], s.tp) / s.tp
    logits = (2 if s.bf16 else 4) * tokens * v_local
    chunks = min(CHUNK_LIVE * HEAD_CHUNK_BYTES, CHUNK_LIVE * 4 * tokens * v_local)
    return logits * (2 if backward else 1) + chunks


# megatron-core 0.16.1 module registration order of one decoder layer's parameters (what
# `named_parameters()` yields and DDP lays out, last first): SelfAttention registers its
# core_attention, linear_proj, linear_qkv, q/k norms; TE's LayerNormLinear its norm weight first
_LAYER_ORDER = {
    "local": ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
              "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
              "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
              "mlp.linear_fc2.weight"),
    "te": ("self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
           "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
           "self_attention.k_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
           "mlp.linear_fc2.weight"),
}


def chunk_parameters(hf: dict[str, Any], *, tp: int, pp: int, stage: int, vpp: int | None = None,
                     te_spec: bool = False) -> list[list[tuple[str, int, bool]]]:
    """Each model chunk of one rank of pipeline stage `stage` (one per virtual stage): its
    parameters in `named_parameters()` order as (name, values on this rank, shared embedding),
    the last being what Megatron marks `shared_embedding` (the embedding and its output copy
    when they are tied across pipeline stages).

    Args:
        hf: the model's HF config.json dict.
        tp: tensor-parallel size (split parameters hold 1/tp of their values, norms all).
        pp: pipeline-parallel size.
        stage: this rank's pipeline stage.
        vpp: virtual stages per rank (None: one chunk).
        te_spec: the Transformer Engine spec's names and order (norms fused into the linears).
    """
    from checkpoint_tools.adapters import EMBED, FINAL_NORM, OUTPUT, get_adapter, layer_range

    spec = "te" if te_spec else "local"
    adapter = get_adapter(hf, spec=spec)
    tied_across = adapter.tied and pp > 1
    layers, v = hf["num_hidden_layers"], vpp or 1
    per_chunk = layers // (pp * v)
    order = {sfx: i for i, sfx in enumerate(_LAYER_ORDER[spec])}
    suffixes = sorted((m.split(".", 3)[3] for m in adapter.stage_names(0, 1) if m.startswith("decoder.layers.0.")),
                      key=lambda sfx: order[sfx])

    def numel(name: str) -> int:
        n = 1
        for dim in adapter.shape(name, tp):
            n *= dim
        return n if adapter.tp_split(name) == "replicated" else n // tp

    chunks = []
    for c in range(v):
        first = (c * pp + stage) * per_chunk if vpp else layer_range(stage, pp, layers).start
        params = [(EMBED, numel(EMBED), tied_across)] if stage == 0 and c == 0 else []
        params += [(f"decoder.layers.{i}.{sfx}", numel(f"decoder.layers.{i}.{sfx}"), False)
                   for i in range(first, first + (per_chunk if vpp else len(layer_range(stage, pp, layers))))
                   for sfx in suffixes]
        if stage == pp - 1 and c == v - 1:
            params.append((FINAL_NORM, numel(FINAL_NORM), False))
            if not adapter.tied or pp > 1:
                params.append((OUTPUT, numel(OUTPUT), tied_across))
        chunks.append(params)
    return chunks


def buffer_layout(params: list[tuple[str, int, bool]], dp: int, distributed_optimizer: bool) -> list[dict]:
    """megatron-core 0.16.1's `_ParamAndGradBuffer` layout of one chunk's parameters (one dtype,
    `overlap_grad_reduce` off, so no size-based buckets): parameters taken last first; with the
    distributed optimizer each starts on a multiple of 64 values, a shared-embedding parameter
    gets a bucket of its own, and each bucket ends on a multiple of lcm(dp, 128). Returns the
    buckets as {"start", "end", "params": [(start, end)]} in buffer order."""
    import math

    def pad(n: int, m: int) -> int:
        return -(-n // m) * m if distributed_optimizer else n

    buckets: list[dict] = []
    start = bucket_start = 0
    current: list[tuple[int, int]] = []

    def close(end: int) -> int:
        nonlocal bucket_start, current
        padded = pad(end, math.lcm(dp, 128))
        buckets.append({"start": bucket_start, "end": padded, "params": current})
        bucket_start, current = padded, []
        return padded

    for _, n, shared in reversed(params):
        start = pad(start, 64)
        own = shared and distributed_optimizer
        if own and current:
            start = close(start)
        current.append((start, start + n))
        start = close(start + n) if own else start + n
    if current:
        close(start)
    return buckets


def _shard_values(buckets: list[dict], dp: int) -> int:
    """Parameter values in the largest DP rank's shard (each bucket split in dp equal parts)."""
    best = 0
    for r in range(dp):
        held = 0
        for b in buckets:
            size = (b["end"] - b["start"]) // dp
            lo, hi = b["start"] + r * size, b["start"] + (r + 1) * size
            held += sum(max(0, min(hi, e) - max(lo, s)) for s, e in b["params"])
        best = max(best, held)
    return best


def state_bytes(hf: dict[str, Any], *, tp: int, pp: int, stage: int, bf16: bool, dp: int = 1,
                distributed_optimizer: bool = False, vpp: int | None = None, te_spec: bool = False) -> dict[str, float]:
    """Parameter count and the bytes of parameters, fp32 main gradients and optimizer states
    (fp32 master copy with bf16, Adam's two moments) on one rank of pipeline stage `stage`:
    `parameters` and `gradients` count the parameters' own values, `*_allocated` what DDP's
    buffers hold with the distributed optimizer's padding (`buffer_layout`), `optimizer` the
    largest DP rank's shard of it.

    Args:
        hf: the model's HF config.json dict.
        tp: tensor-parallel size: each rank holds its 1/tp shard of the stage (replicated norms whole).
        pp: pipeline-parallel size: the layers split evenly over `pp` stages.
        stage: the pipeline stage, in [0, pp) (the first holds the embedding, the last the output layer).
        bf16: bf16 parameters (2 B) with an fp32 master copy in the optimizer (12 B per parameter);
            False: fp32 parameters (4 B) and Adam's two moments only (8 B).
        dp: data-parallel size; divides the optimizer states only with `distributed_optimizer`.
        distributed_optimizer: the optimizer states are sharded over `dp` ranks; False: each rank holds all.
        vpp: virtual pipeline stages per rank (each chunk has a buffer of its own).
        te_spec: the Transformer Engine spec's parameter order (it moves the padding only).
    """
    chunks = chunk_parameters(hf, tp=tp, pp=pp, stage=stage, vpp=vpp, te_spec=te_spec)
    n = sum(v for params in chunks for _, v, _ in params)
    layouts = [buffer_layout(params, dp, distributed_optimizer) for params in chunks]
    padded = sum(b[-1]["end"] for b in layouts if b)
    pe, opt = (2, 12) if bf16 else (4, 8)
    held = sum(_shard_values(b, dp) for b in layouts) if distributed_optimizer else n
    # DDP allocates a parameter buffer (params become views of it) only for the distributed optimizer
    return {"numel": n, "parameters": n * pe, "gradients": n * 4.0, "optimizer": held * opt,
            "parameters_allocated": (padded if distributed_optimizer else n) * pe, "gradients_allocated": padded * 4.0}


def _stage_rows(hf: dict[str, Any], s: Setting, stage: int) -> list[tuple[str, float, str]]:
    st = state_bytes(hf, tp=s.tp, pp=s.pp, stage=stage, bf16=s.bf16, dp=s.dp,
                     distributed_optimizer=s.distributed_optimizer, vpp=s.vpp, te_spec=s.te_spec)
    n, pe, opt = st["numel"], 2 if s.bf16 else 4, 12 if s.bf16 else 8
    shard = s.dp if s.distributed_optimizer else 1
    layers = hf["num_hidden_layers"] // s.pp
    in_flight = s.pp - stage  # 1F1B: stage k holds pp - k micro-batches
    vpp = 1 + (s.pp - 1) / (s.pp * s.vpp) if s.vpp else 1.0  # interleaved schedule's extra
    kept, rerun = _layer_bytes(hf, s, s.micro_batch_tokens, s.recompute)
    last = stage == s.pp - 1
    head = _head_bytes(hf, s, s.micro_batch_tokens, backward=True) if last else 0.0
    padded = " (padded buffer)" if s.distributed_optimizer else ""
    rows = [
        ("parameters", st["parameters_allocated"], f"{n / 1e6:,.1f} M params on this rank x {pe} B{padded}"),
        ("gradients (fp32 main_grad)", st["gradients_allocated"], f"x 4 B (grad_reduce_in_fp32){padded}"),
        ("optimizer (Adam" + (", fp32 master)" if s.bf16 else ")"), st["optimizer"],
         f"x {opt} B" + (f" / dp={s.dp} (distributed optimizer)" if shard > 1 else "")),
        ("activations", kept * layers * in_flight * vpp + rerun,
         f"{layers} layers x {in_flight} micro-batch(es) of {s.micro_batch_tokens} tokens"
         + (" + one layer re-run" if rerun else "")),
        ("logits + grad + fp32 chunks", head, "last stage: [tokens x vocab/tp] twice in the model dtype"),
    ]
    whole, _ = _layer_bytes(hf, s, s.recompute_tokens, "none")
    recompute_peak = whole + (_head_bytes(hf, s, s.recompute_tokens, backward=False) if last else 0.0)
    extra = max(0.0, recompute_peak - rows[3][1] - rows[4][1])  # forward-only pass, outside the step
    rows.append(("recompute pass (forward-only) extra", extra,
                 f"{s.recompute_tokens} tokens per micro-batch (learner.logprob_chunk_tokens)"))
    return rows


def plan_for(hf: dict[str, Any], s: Setting) -> MemoryPlan:
    """The plan of the worst pipeline stage under setting `s`."""
    stages = [_stage_rows(hf, s, k) for k in range(s.pp)]
    worst = max(range(s.pp), key=lambda k: sum(b for _, b, _ in stages[k]))
    rows = stages[worst]
    if s.on_gpu:
        rows.append(("rollout engines on this GPU", s.engine_fraction * s.gpu_gib * GIB,
                     f"learner.engine_memory_fraction={s.engine_fraction:g}"))
        rows.append(("runtime allowance", RESERVE_GIB * GIB, "CUDA context, NCCL buffers, fragmentation"))
    return MemoryPlan(s, worst, rows)


def learner_world(cfg) -> tuple[int, str]:
    """(learner ranks, how that is configured): one node locally, `trainer_nodes` on Slurm."""
    procs = cfg.launch.learner_procs_per_node
    if cfg.launch.mode == "slurm":
        return procs * cfg.launch.trainer_nodes, (f"launch.learner_procs_per_node={procs} x "
                                                  f"launch.trainer_nodes={cfg.launch.trainer_nodes}")
    return procs, f"launch.learner_procs_per_node={procs} (launch.mode={cfg.launch.mode}: one node)"


def setting_of(cfg, spec: str | None = None) -> Setting:
    """Resolve a RunConfig into the plan's setting (GPU run: launch.trainer.gpus_per_node > 0).
    `spec`: the layer spec the learner resolved ("te" | "local"); None: the config's, with
    `model.spec=auto` on GPUs planned as TE (what a node with megatron-darl[gpu] resolves to)."""
    from megatron_darl.learner.packing import round_up, sequence_multiple

    on_gpu = cfg.launch.trainer.gpus_per_node > 0
    par, model, lc = cfg.parallel, cfg.model, cfg.learner
    world, _ = learner_world(cfg)
    multiple = sequence_multiple(model.fp8, par.tp, par.sequence_parallel)
    max_seq = round_up(cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens, multiple)
    dist_opt = on_gpu if cfg.optim.distributed_optimizer is None else cfg.optim.distributed_optimizer
    return Setting(
        tp=par.tp, pp=par.pp, vpp=par.vpp, dp=max(1, world // (par.tp * par.pp)),
        sequence_parallel=par.sequence_parallel, recompute=model.recompute,
        recompute_modules=tuple(model.recompute_modules),
        bf16=model.dtype == "bf16" or (model.dtype == "auto" and on_gpu),
        te_spec=spec == "te" if spec else model.spec == "te" or (model.spec == "auto" and on_gpu),
        distributed_optimizer=dist_opt,
        micro_batch_tokens=max(lc.micro_batch_tokens, max_seq),  # a longer row travels alone
        recompute_tokens=max(lc.recompute_tokens, max_seq), max_seq=max_seq, multiple=multiple,
        gpu_gib=lc.gpu_memory_gib, engine_fraction=lc.engine_memory_fraction, on_gpu=on_gpu,
        flash_attention=model.attention != "dot_product")


def _alternatives(s: Setting) -> list[tuple[str, Setting]]:
    alts = []
    if s.recompute != "full":
        alts.append(("model.recompute=full", dataclasses.replace(s, recompute="full")))
    if s.tp > 1 and not s.sequence_parallel and s.te_spec:
        alts.append(("parallel.sequence_parallel=true", dataclasses.replace(s, sequence_parallel=True)))
    if not s.distributed_optimizer and s.dp > 1 and s.on_gpu:
        alts.append(("optim.distributed_optimizer=true", dataclasses.replace(s, distributed_optimizer=True)))
    for div in (2, 4, 8):
        tokens = max(s.micro_batch_tokens // div, s.max_seq)
        if tokens < s.micro_batch_tokens:
            alts.append((f"learner.micro_batch_tokens={tokens}",
                         dataclasses.replace(s, micro_batch_tokens=tokens, recompute_tokens=min(s.recompute_tokens,
                                                                                                 tokens))))
    return alts


def plan_run(cfg, hf: dict[str, Any], spec: str | None = None) -> MemoryPlan:
    """The recipe's plan (`spec` as in `setting_of`); when it does not fit, `advice` lists the
    single changes that do."""
    s = setting_of(cfg, spec)
    plan = plan_for(hf, s)
    if not plan.fits:
        for what, alt in _alternatives(s):
            other = plan_for(hf, alt)
            if other.fits:
                plan.advice.append(f"{what} ({other.total / GIB:.1f} GiB)")
    return plan
