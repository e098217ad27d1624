"""`python -m megatron_darl <command> ...`: the console scripts without installed entry points."""

import sys

from megatron_darl import cli

COMMANDS = {
    "train": cli.train_main,
    "engine": cli.engine_main,
    "convert": cli.convert_main,
    "logprobs": cli.logprobs_main,
    "eval": cli.eval_main,
    "launch": cli.launch_main,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m megatron_darl {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    name = sys.argv.pop(1)
    sys.argv[0] = f"darl-{name}"
    fn = COMMANDS[name]
    sys.exit(fn() if name != "train" else fn(sys.argv[1:]))
