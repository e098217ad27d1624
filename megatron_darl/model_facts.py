"""Facts about the model that every process may need: its config.json shapes and its context.

What it is: `model_shapes(cfg)` finds the model's config.json facts without loading weights
(an HF folder, a `darl-convert` Megatron folder, the built-in demo model, or, for `--plan` on a
machine without the weights, the published shapes of the models the shipped recipes name,
`PUBLISHED`); `model_context(cfg)` its context (`max_position_embeddings`); `context_limit(cfg,
split)` the `data.ContextLimit` a split's prompts must fit with their answers, which the rollout
manager, evaluation and the warm start hand to their prompt loaders. It sits at the package root
so that the learner, the rollout manager, evaluation and the launcher read one definition
without importing each other's folders.
What it is not: the checks of those shapes against the parallel layout and the memory plan
(`learner/checks.py`), or the loading of a model (`learner/`, `engine/`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

# Published config.json values of the models the shipped GPU recipes train (Hugging Face
# Qwen/Qwen3-1.7B and Qwen/Qwen3-4B; the same figures as slime's scripts/models/qwen3-*.sh), so
# `darl-train --plan` answers before the weights are on the machine.
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
                   "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen3-4b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
                 "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
}


def _builtin_shapes(cfg) -> dict[str, Any]:
    from megatron_darl.config.learner import BUILTIN_MODEL, TINY_QWEN3

    if cfg.model.hf_dir != BUILTIN_MODEL:
        raise ValueError(f"model.hf_dir={cfg.model.hf_dir!r}: unknown built-in model; allowed: {BUILTIN_MODEL}")
    from tokenizers import Tokenizer

    from megatron_darl.data.tokenizers import resolve_tokenizer_dir

    tok_dir = resolve_tokenizer_dir(cfg.model.tokenizer or "builtin:demo")
    vocab = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return dict(TINY_QWEN3, vocab_size=vocab)  # the warm start sizes the embedding to the tokenizer


def model_shapes(cfg) -> tuple[dict[str, Any] | None, str]:
    """(config.json facts, where they came from); (None, reason) when they cannot be known."""
    hf_dir = cfg.model.hf_dir
    if hf_dir.startswith("builtin:"):
        return _builtin_shapes(cfg), f"built-in model {hf_dir}"
    from checkpoint_tools.mcore_format import META_FILE, read_meta

    if os.path.isfile(os.path.join(hf_dir, META_FILE)):
        return read_meta(hf_dir).hf_config, f"{hf_dir}/{META_FILE}"
    path = os.path.join(hf_dir, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh), path
    name = os.path.basename(os.path.normpath(hf_dir)).lower()
    if name in PUBLISHED:
        return dict(PUBLISHED[name]), f"published config of {os.path.basename(os.path.normpath(hf_dir))} " \
                                      f"(no config.json in {hf_dir!r})"
    return None, f"no config.json in {hf_dir!r}"


def model_context(cfg) -> tuple[int | None, str]:
    """(the model's context, the file it came from): `max_position_embeddings` of its config.json
    (the built-in model's without its tokenizer), the most positions a prompt plus its
    generation may take on darl-engine and on SGLang, which serve `model.hf_dir` (external SGLang
    servers too: their context is the model's); (None, why) when it cannot be known."""
    from megatron_darl.config.learner import BUILTIN_MODEL, TINY_QWEN3

    if cfg.model.hf_dir == BUILTIN_MODEL:
        return int(TINY_QWEN3["max_position_embeddings"]), f"built-in model {BUILTIN_MODEL} (config/learner.py)"
    if cfg.model.hf_dir.startswith("builtin:"):
        return None, f"unknown built-in model {cfg.model.hf_dir!r}"
    hf, source = model_shapes(cfg)
    if hf is None or hf.get("max_position_embeddings") is None:
        return None, source if hf is None else f"{source} has no max_position_embeddings"
    return int(hf["max_position_embeddings"]), source


def context_limit(run_cfg, split: str = "train"):
    """The `data.ContextLimit` a split's prompts must fit with their answers: the model's
    `max_position_embeddings` (`model_context`) less `rollout.max_new_tokens` (train; the rollout
    manager asks every request of a prompt for exactly the rest of it) or the evaluation's
    `eval.max_new_tokens` (eval; None: rollout's). None when the model's context cannot be read
    (the preflight names a missing config.json)."""
    from megatron_darl.data.formatting import ContextLimit
    from megatron_darl.data.sources import SPLITS

    if split not in SPLITS:
        raise ValueError(f"split {split!r}; allowed: {SPLITS}")
    context, source = model_context(run_cfg)
    if context is None:
        logging.getLogger(__name__).warning("model context unknown (%s): prompts are not checked against it", source)
        return None
    key, new = "rollout.max_new_tokens", run_cfg.rollout.max_new_tokens
    if split == "eval" and run_cfg.eval.max_new_tokens:
        key, new = "eval.max_new_tokens", run_cfg.eval.max_new_tokens
    return ContextLimit(context=context, max_new_tokens=new, key=key, source=source)
