"""`python -m megatron_darl <command> ...`: the console scripts without installed entry points."""

import sys

from megatron_darl.launch.cli import COMMANDS

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m megatron_darl {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    name = sys.argv.pop(1)
    sys.argv[0] = f"darl-{name}"
    sys.exit(COMMANDS[name](sys.argv[1:]))
