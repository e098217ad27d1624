"""D-ARL algorithm library: advantages, rollout IS, PPO variants, selection, P-MIS.

Pure torch functions, importable alone (no Megatron, no config, no torch.distributed).
The public contract and a table of functions are in `megatron_darl.algo.api`.

The functions load on first use (`algo.grpo_advantages`, `from megatron_darl.algo import ...`):
importing `megatron_darl.algo.config`, the algorithm's config section that every process reads,
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import *  # noqa: F403


def __getattr__(name: str) -> Any:
    api = importlib.import_module(f"{__name__}.api")  # sets every name of its __all__ here
    if name != "__all__" and name not in api.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(api, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(importlib.import_module(f"{__name__}.api").__all__))
