"""Both tokenizers load offline through AutoTokenizer; the demo one is small, deterministic and
covers every character of the arithmetic task prompts."""

import pytest

from megatron_darl.data.api import PromptRecord
from megatron_darl.data.formatting import PromptFormatter, UnknownCharacters
from megatron_darl.data.procedural import ProceduralSource
from megatron_darl.data.tokenizers import (
    DEMO_CHARS,
    build_demo_tokenizer,
    load_tokenizer,
    qwen3_tokenizer_dir,
    resolve_tokenizer_dir,
)

TEXT = "State the final answer: 12 + 34 - (5 * 6) / 2 = ?\nCalculate -7."


def rec(question, **meta):
    return PromptRecord(question=question, task="procedural", answer={}, metadata=meta, where="test[0]")


def test_demo_build_is_deterministic_and_small(tmp_path):
    a, b = build_demo_tokenizer(tmp_path / "a"), build_demo_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    tok = load_tokenizer(str(a))
    assert len(tok) < 128 and len(tok) == len(set(DEMO_CHARS)) + 5
    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4]) == specials
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 0 and tok.bos_token_id is None


def test_demo_cache_is_built_once_and_reused(tmp_path):
    folder = resolve_tokenizer_dir("builtin:demo", tmp_path)
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert resolve_tokenizer_dir("builtin:demo", tmp_path) == folder
    build_demo_tokenizer(folder)  # identical content: the folder is left alone for its readers
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp


def test_demo_roundtrip_is_character_level(demo_tok):
    ids = demo_tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)  # one token per character, nothing added
    assert demo_tok.decode(ids) == TEXT
    answer = demo_tok.encode("-42", add_special_tokens=False) + [demo_tok.eos_token_id]
    assert demo_tok.decode(answer, skip_special_tokens=True) == "-42"


def test_demo_chat_template(demo_tok):
    text = PromptFormatter(demo_tok).render(rec("1 + 2 ="))
    assert text == "<|im_start|>user\n1 + 2 =<|im_end|>\n<|im_start|>assistant\n"
    ids = PromptFormatter(demo_tok).encode(rec("1 + 2 ="))
    assert ids[0] == demo_tok.convert_tokens_to_ids("<|im_start|>") and demo_tok.decode(ids) == text
    sys_text = PromptFormatter(demo_tok, system_prompt="Answer only.").render(rec("1 + 2 ="))
    assert sys_text.startswith("<|im_start|>system\nAnswer only.<|im_end|>\n<|im_start|>user\n")


@pytest.mark.parametrize(
    "dataset, kwargs",
    [
        ("chain_sum", {}),
        ("chain_sum", {"allow_negation": True}),
        ("basic_arithmetic", {}),
        ("basic_arithmetic", {"format_style": "natural"}),
    ],
)
def test_demo_vocab_covers_arithmetic_prompts(demo_tok, dataset, kwargs):
    src = ProceduralSource(dataset, size=300, seed=3, dataset_kwargs=kwargs)
    fmt = PromptFormatter(demo_tok, max_prompt_tokens=4096)
    for i in range(len(src)):
        r = src.record(i)
        assert demo_tok.decode(fmt.encode(r)) == fmt.render(r)
        assert demo_tok.unk_token_id not in demo_tok.encode(r.answer["entry"]["answer"], add_special_tokens=False)


def test_demo_unknown_character_is_named(demo_tok):
    with pytest.raises(UnknownCharacters, match=r"\['£', '€'\]"):
        PromptFormatter(demo_tok).encode(rec("Pay £5 or €6"))


def test_qwen3_offline_roundtrip_and_chat_template(qwen_tok):
    assert (qwen3_tokenizer_dir() / "tokenizer.json").is_file()
    assert len(qwen_tok) > 150_000 and qwen_tok.eos_token == "<|im_end|>" and qwen_tok.pad_token == "<|endoftext|>"
    ids = qwen_tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) < len(TEXT) and qwen_tok.decode(ids) == TEXT
    assert qwen_tok.encode("Pay £5", add_special_tokens=False)  # byte-level: no unknown characters
    fmt = PromptFormatter(qwen_tok, system_prompt="Be brief.", chat_kwargs={"enable_thinking": False})
    text = fmt.render(rec("What is 2+3?"))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = fmt.encode(rec("What is 2+3?"))
    assert ids[0] == qwen_tok.convert_tokens_to_ids("<|im_start|>") and qwen_tok.decode(ids) == text


def test_tokenizer_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="builtin:qwen3, builtin:demo"):
        load_tokenizer("builtin:llama")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_demo_tools_keeps_the_demo_ids_and_adds_four_single_tokens(tmp_path):
    demo = load_tokenizer("builtin:demo", cache_dir=tmp_path)
    tools = load_tokenizer("builtin:demo-tools", cache_dir=tmp_path)
    assert len(tools) == len(demo) + 4
    assert tools.encode(TEXT, add_special_tokens=False) == demo.encode(TEXT, add_special_tokens=False)
    text = "<tool_call>12 + 3</tool_call><tool_response>15\n</tool_response>15"
    ids = tools.encode(text, add_special_tokens=False)
    tags = [tools.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<tool_response>",
                                                     "</tool_response>")]
    assert tags == list(range(len(demo), len(demo) + 4))
    assert ids[0] == tags[0] and ids[7] == tags[1] and ids[8] == tags[2] and ids[-3] == tags[3]
    assert len(ids) == 4 + len("12 + 3") + len("15\n") + len("15")
    assert tools.decode(ids) == text and tools.decode(ids, skip_special_tokens=True) == text
    folders = {resolve_tokenizer_dir(spec, tmp_path).name for spec in ("builtin:demo", "builtin:demo-tools")}
    assert len(folders) == 2, "each vocabulary has its own cache folder"
