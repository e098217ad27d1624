"""`python -m megatron_darl.trainer --run-info RUN_DIR/run_info.json`: one trainer (learner) rank,
as the launcher starts it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)."""

import sys

from megatron_darl.trainer.rank import main

sys.exit(main())
