"""`python -m megatron_darl.engine --model DIR --port P`: darl-engine, the embedded SGLang-protocol
server, as an engine host starts it (the same as the `darl-engine` command)."""

import sys

from megatron_darl.engine.server import main

sys.exit(main())
