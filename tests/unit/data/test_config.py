"""DataConfig validation and source-spec parsing: bad input is named, good input passes."""

import pytest
from omegaconf import OmegaConf

from megatron_darl.config.data import DataConfig, SourceSpec


def fields_of(errs):
    return [f for f, _ in errs]


def test_default_config_is_valid():
    assert DataConfig().check() == []


@pytest.mark.parametrize(
    "spec, kind, target",
    [
        ("reasoning_gym:chain_sum", "reasoning_gym", "chain_sum"),
        ("jsonl:/data/gsm8k/test.jsonl", "jsonl", "/data/gsm8k/test.jsonl"),
        ("parquet:C:/x.parquet", "parquet", "C:/x.parquet"),  # only the first colon separates
        ("humaneval", "humaneval", ""),
    ],
)
def test_spec_parse(spec, kind, target):
    assert SourceSpec.parse(spec) == SourceSpec(kind, target)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("hf:openai/gsm8k", ["unknown kind 'hf'", "reasoning_gym:<dataset>"]),
        ("jsonl", ["needs a target"]),
        ("reasoning_gym:", ["needs a target"]),
        ("humaneval:extra", ["takes no argument"]),
    ],
)
def test_spec_errors_name_the_problem(spec, words):
    with pytest.raises(ValueError) as e:
        SourceSpec.parse(spec)
    for w in words:
        assert w in str(e.value)


def test_check_names_each_bad_field(tmp_path):
    cfg = DataConfig(
        source="reasoning_gym:no_such_task",
        eval_source=f"jsonl:{tmp_path}/missing.jsonl",
        format="custom",
        size=0,
        eval_size=-1,
        max_prompt_tokens=0,
        system_prompt="be brief",
        chat_template=False,
        prompt_template="{question",
    )
    errs = dict(cfg.check())
    assert "no_such_task" in errs["source"]
    assert "eval_source" not in errs  # a missing file is a pre-flight error, not a config error
    assert "missing.jsonl" in dict(cfg.missing_files())["eval_source"]
    assert "prompt_field" in errs
    assert set(fields_of(cfg.check())) >= {"size", "eval_size", "max_prompt_tokens", "system_prompt", "prompt_template"}


def test_check_rejects_positional_template_and_stray_custom_fields():
    errs = dict(DataConfig(prompt_template="Q: {}", prompt_field="q").check())
    assert "positional" in errs["prompt_template"]
    raw_with_kwargs = DataConfig(chat_template=False, chat_kwargs={"enable_thinking": False})
    assert "chat_template=true" in dict(raw_with_kwargs.check())["chat_kwargs"]
    assert "format=custom" in errs["format"]


def test_existing_file_and_custom_fields_pass(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"q": "1+1", "a": "2"}\n')
    assert DataConfig(source=f"jsonl:{p}", format="custom", prompt_field="q", answer_field="a").check() == []


def test_omegaconf_structured_roundtrip():
    """The lead's loader builds RunConfig with OmegaConf structured configs and dotted overrides."""
    base = OmegaConf.structured(DataConfig)
    merged = OmegaConf.merge(
        base, OmegaConf.from_dotlist(["dataset_kwargs.min_terms=3", "size=64", "system_prompt=hi"])
    )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, DataConfig)
    assert cfg.dataset_kwargs == {"min_terms": 3} and cfg.size == 64 and cfg.system_prompt == "hi"
    with pytest.raises(Exception, match="size"):
        OmegaConf.merge(base, OmegaConf.from_dotlist(["size=many"]))
    assert DataConfig._choices["format"][0] == "auto"
