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
GQA (q of a*d, k/v of g*d), q/k RMSNorm, and flash attention on the TE spec (softmax
statistics instead of the a*s^2 score matrix).

Formulas, per micro-batch of T tokens, e bytes per activation (2 in bf16), tp t:
- outside the TP region, kept whole unless sequence parallel (then / t): the inputs and outputs
  of the two RMSNorms, 4eTh;
- inside (/ t): q/k before their norms e T (a+g) d (Qwen3), q, k, v e T (a+2g) d, attention
  output e T a d, attention internals 4Ta (flash, fp32 log-sum-exp) or e a T min(T, S) (local
  spec, softmax probabilities), fc1 output 2eTF, SwiGLU output eTF (+ eTF for the separate silu
  output without the fused kernel);
- selective recompute drops the internals of the modules it recomputes (core_attn, mlp); full
  recompute keeps only each layer's input eTh (/ t with sequence parallel), plus one layer's
  activations while that layer is re-run in backward;
- with 1F1B pipelining stage k holds pp - k micro-batches of its L/pp layers;
- the head keeps the logits e T V/t for backward, the gradient e T V/t, and fp32 working
  chunks of `logprobs.HEAD_CHUNK_BYTES` (two live at once, one more allowed for conversions).
Bytes per parameter (Megatron-LM docs, "Distributed Optimizer"): bf16 parameters with fp32
main gradients 2 + 4, Adam with fp32 master weights 12 (sharded over DP by the distributed
optimizer: 12 / dp); fp32 parameters 4 + 4 + Adam 8 (8 / dp).
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
    te_spec: bool  # flash attention and the fused SwiGLU kernel
    distributed_optimizer: bool
    micro_batch_tokens: int  # the budget, or one sequence longer than it
    recompute_tokens: int  # the forward-only recompute pass's budget
    max_seq: int  # longest sequence (prompt + response)
    multiple: int  # width alignment (FP8 / sequence parallel)
    gpu_gib: float
    engine_fraction: float
    on_gpu: bool


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
                 f"{'TE spec' if s.te_spec else 'local spec'}; worst stage: {self.stage})"]
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
    # local spec: megatron-core's DotProductAttention keeps, per score, the fp32 softmax output
    # (attention_softmax_in_fp32, for the softmax backward) and its bf16 copy (for the bmm): 6 B
    per_score = 4 + (e if s.bf16 else 0)
    core = 4 * tokens * a if s.te_spec else per_score * a * tokens * min(tokens, s.max_seq)
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


def state_bytes(hf: dict[str, Any], *, tp: int, pp: int, stage: int, bf16: bool, dp: int = 1,
                distributed_optimizer: bool = False) -> dict[str, float]:
    """Parameter count and the bytes of parameters, fp32 main gradients and optimizer states
    (fp32 master copy with bf16, Adam's two moments) on one rank of pipeline stage `stage`.

    Args:
        hf: the model's HF config.json dict.
        tp: tensor-parallel size: each rank holds its 1/tp shard of the stage (replicated norms whole).
        pp: pipeline-parallel size: the layers split evenly over `pp` stages.
        stage: the pipeline stage, in [0, pp) (the first holds the embedding, the last the output layer).
        bf16: bf16 parameters (2 B) with an fp32 master copy in the optimizer (12 B per parameter);
            False: fp32 parameters (4 B) and Adam's two moments only (8 B).
        dp: data-parallel size; divides the optimizer states only with `distributed_optimizer`.
        distributed_optimizer: the optimizer states are sharded over `dp` ranks; False: each rank holds all.
    """
    from checkpoint_tools.adapters import get_adapter

    n = get_adapter(hf).rank_numel(stage, pp, tp)
    shard = dp if distributed_optimizer else 1
    return {"numel": n, "parameters": n * (2 if bf16 else 4), "gradients": n * 4.0,
            "optimizer": n * (12 if bf16 else 8) / shard}


def _stage_rows(hf: dict[str, Any], s: Setting, stage: int) -> list[tuple[str, float, str]]:
    st = state_bytes(hf, tp=s.tp, pp=s.pp, stage=stage, bf16=s.bf16, dp=s.dp,
                     distributed_optimizer=s.distributed_optimizer)
    n, pe, opt = st["numel"], 2 if s.bf16 else 4, 12 if s.bf16 else 8
    shard = s.dp if s.distributed_optimizer else 1
    layers = hf["num_hidden_layers"] // s.pp
    in_flight = s.pp - stage  # 1F1B: stage k holds pp - k micro-batches
    vpp = 1 + (s.pp - 1) / (s.pp * s.vpp) if s.vpp else 1.0  # interleaved schedule's extra
    kept, rerun = _layer_bytes(hf, s, s.micro_batch_tokens, s.recompute)
    last = stage == s.pp - 1
    head = _head_bytes(hf, s, s.micro_batch_tokens, backward=True) if last else 0.0
    rows = [
        ("parameters", st["parameters"], f"{n / 1e6:,.1f} M params on this rank x {pe} B"),
        ("gradients (fp32 main_grad)", st["gradients"], "x 4 B (grad_reduce_in_fp32)"),
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
        gpu_gib=lc.gpu_memory_gib, engine_fraction=lc.engine_memory_fraction, on_gpu=on_gpu)


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
