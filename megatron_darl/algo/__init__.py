"""D-ARL algorithm library: advantages, rollout IS, PPO variants, selection, P-MIS.

Pure torch functions, importable alone (no Megatron, no config, no torch.distributed).
The public contract and a table of functions are in `megatron_darl.algo.api`.
"""

from .api import *  # noqa: F401,F403
from .api import __all__  # noqa: F401
