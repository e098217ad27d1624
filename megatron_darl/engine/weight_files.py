"""Reading one safetensors weight file for the embedded engine, every failure named.

What it is: `read_weight_file(path, expected, skip)`, the per-file half of
`decoder.load_hf_tensors`: it opens the file, and checks each tensor's name, dtype, shape and
values against the running model, returning them as fp32. Every way a file can be wrong raises
`WeightLoadError` naming the file and the cause, so `/update_weights_from_disk` answers 400 and
keeps the old weights: a file that is empty, whose header is cut off or whose data is shorter
than its header says (safetensors' own error, quoted), a tensor that is not floating point,
an unexpected name, a wrong shape, NaN or Inf.
What it is not: the folder-level checks (no file, missing tensors: `decoder.load_hf_tensors`)
or the model built from the tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class WeightLoadError(ValueError):
    """A weight folder does not fit the running model (names the file or tensor)."""


def read_weight_file(path: Path, expected: dict[str, tuple[int, ...]], skip: Callable[[str], bool],
                     arch: str = "the model") -> dict[str, torch.Tensor]:
    """The tensors of `path` as fp32, each checked; names for which `skip(name)` holds are left
    out. Raises WeightLoadError naming `path` and the first problem (nothing is half-read)."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if skip(name):
                    continue
                if name not in expected:
                    raise WeightLoadError(f"{path.name}: unexpected tensor {name!r} for {arch}")
                tensors[name] = _checked(path, name, f.get_tensor(name), expected[name])
    except SafetensorError as exc:  # an empty file, a cut header, data shorter than the header says
        size = path.stat().st_size if path.exists() else 0
        raise WeightLoadError(f"{path.name}: not a readable safetensors file ({size} bytes): {exc}") from None
    return tensors


def _checked(path: Path, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not t.is_floating_point():  # an integer or bool tensor would be cast silently into nonsense weights
        raise WeightLoadError(f"{path.name}: tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, "
                              f"weights must be floating point (float32, bfloat16, float16)")
    if tuple(t.shape) != shape:
        raise WeightLoadError(f"{path.name}: tensor {name!r} has shape {tuple(t.shape)}, "
                              f"the running model expects {shape}")
    t = t.to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise WeightLoadError(f"{path.name}: tensor {name!r} has {bad} non-finite value(s) (NaN or Inf)")
    return t
