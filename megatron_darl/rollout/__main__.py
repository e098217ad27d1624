"""`python -m megatron_darl.rollout --run-info RUN_DIR/run_info.json`: the rollout manager process,
as the launcher starts it beside the ring buffer (or standalone: `--config --ring --weight-notice`)."""

import sys

from megatron_darl.rollout.manager_process import main

sys.exit(main())
