"""Warm start for the CPU demo: a tiny Qwen3-architecture model and a short supervised stage.

What it is: `prepare_model(cfg)`, which resolves `model.hf_dir: builtin:tiny-qwen3` into a real
Hugging Face folder under `<run_dir>/model`: a randomly initialised tiny Qwen3 (GQA, QK-norm,
tied embeddings) sized to the tokenizer, then `train.sft_steps` of supervised training on the
reference answers of the task (a reasoning-gym entry's answer, or a math file's ground truth;
prompt tokens masked out) so that RL starts from a policy that is sometimes right. The result
is cached: a second run with the same settings reuses the folder (keyed by a hash of everything
that shaped it, the data file's size and time included). `preflight(cfg)` refuses, before
start, a source without reference answers.
What it is not: part of RL training. Any other `model.hf_dir` is returned unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from megatron_darl.config import RunConfig

log = logging.getLogger(__name__)

BUILTIN_MODEL = "builtin:tiny-qwen3"
# 3 layers, d=128: small enough that the demo's warm start and RL run in minutes on 2 cores
# (README, "On a fresh machine")
TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "torch_dtype": "float32",
}
SFT_BATCH = 256
SFT_LR = 2e-3


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


def preflight(cfg: RunConfig) -> list[str]:
    """Before start, for the built-in model on a file source: its warm start trains on reference
    answers, so the rows must have them (code tasks and custom files without data.answer_field do
    not), and its tokenizer (the demo's character set) must encode some of them. Generated
    (reasoning-gym) tasks have both by construction."""
    if cfg.model.hf_dir != BUILTIN_MODEL or cfg.data.missing_files():
        return []
    from megatron_darl.data.sources import build_loader, build_source
    from megatron_darl.data.tokenizers import load_tokenizer

    try:
        source = build_source(cfg.data, "train")
    except (ValueError, OSError):
        return []  # the data checks report why the source cannot be read
    if getattr(source, "lazy", False):
        return []
    record = source.record(0)
    if cfg.train.sft_steps > 0 and record.answer.get("ground_truth") in (None, ""):
        return [f"train.sft_steps={cfg.train.sft_steps}: the warm start of {BUILTIN_MODEL} trains on reference "
                f"answers, and data.source={cfg.data.source} has none ({record.where} is a {record.task} task "
                f"without a ground truth); use a reasoning_gym task or a math file with answers, or set "
                f"train.sft_steps=0 (a random model)"]
    tokenizer = cfg.model.tokenizer or "builtin:demo"
    quiet = logging.getLogger(f"{__name__}.preflight")  # the run names each bad row when it starts
    quiet.propagate = False
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())  # without one, logging's last resort prints them
    try:
        build_loader(cfg.data, load_tokenizer(tokenizer), logger=quiet, progress=False)
    except ValueError as e:
        return [f"data.source: {BUILTIN_MODEL} with tokenizer {tokenizer} cannot use this data: {e}"]
    return []


def _fingerprint(cfg: RunConfig, tok_dir: str) -> str:
    from megatron_darl.data.api import SourceSpec

    spec = SourceSpec.parse(cfg.data.source)
    stat = os.stat(spec.target) if spec.kind in ("jsonl", "parquet") else None  # an edited file: a new warm start
    key = {"tiny": TINY_QWEN3, "sft_steps": cfg.train.sft_steps, "seed": cfg.train.seed,
           "batch": SFT_BATCH, "lr": SFT_LR, "tokenizer": tok_dir, "data": {
               "source": cfg.data.source, "kwargs": dict(cfg.data.dataset_kwargs),
               "template": cfg.data.prompt_template, "chat": cfg.data.chat_template, "seed": cfg.data.seed,
               "file": [stat.st_size, stat.st_mtime_ns] if stat else None}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def prepare_model(cfg: RunConfig) -> RunConfig:
    """Return `cfg` with `model.hf_dir` (and `model.tokenizer`) pointing at real folders."""
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
    stats: dict[str, Any] = {"sft_steps": cfg.train.sft_steps}
    if cfg.train.sft_steps > 0:
        data = replace(cfg.data, seed=cfg.data.seed + 7919)  # another order than the RL stream
        loader = build_loader(data, tok, "train")
        stats.update(supervised_steps(model, tok, loader, cfg.train.sft_steps))
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "warmstart.json"), "w", encoding="utf-8") as fh:
        json.dump({"fingerprint": fingerprint, **stats}, fh, indent=1)
    if os.path.isdir(out):
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)


def supervised_steps(model: torch.nn.Module, tok: Any, loader: Any, steps: int,
                     batch: int = SFT_BATCH, lr: float = SFT_LR) -> dict[str, float]:
    """Cross-entropy on answer tokens only (prompt masked), AdamW, a progress bar."""
    import torch
    from tqdm import trange

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0, loss_val = time.time(), float("nan")
    bar = trange(steps, desc="warm start (SFT)", unit="step", mininterval=1.0)
    for _ in bar:
        prompts = loader.next_batch(batch)
        seqs = [(p.input_ids, tok.encode(reference_answer(p), add_special_tokens=False) + [eos]) for p in prompts]
        width = max(len(a) + len(b) for a, b in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for i, (p, a) in enumerate(seqs):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
            attn[i, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.detach())
        bar.set_postfix(loss=f"{loss_val:.3f}", refresh=False)
    model.eval()
    return {"sft_final_loss": loss_val, "sft_seconds": round(time.time() - t0, 1)}
