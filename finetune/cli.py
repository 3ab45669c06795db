"""The ``finetune`` command: one entry point for training and for using a trained model.

Usage::

    finetune train [--config F] [--data FILE --text COLUMN --label COLUMN --model NAME --output DIR] [section.key=value ...]
    finetune predict OUTPUT_DIR "a text" ... | --file FILE [--output FILE]
    finetune score OUTPUT_DIR --file FILE [section.key=value ...]
    finetune plot OUTPUT_DIR [OUTPUT_DIR ... --output FILE]
    finetune sweep [--config F] --sweep SWEEP.yaml [--seeds N] [--storage URL] [section.key=value ...]

Where the command is not on the PATH: ``python -m finetune train ...``.
Several processes: ``accelerate launch -m finetune.cli train ...`` (or
``accelerate launch finetune/train.py ...`` from a clone); ``predict`` and
``score`` the same way share the batches among the processes. ``finetune
COMMAND --help`` explains each command.
"""

from __future__ import annotations

import difflib
import shlex
import sys

COMMANDS = {
    "train": ("finetune.train", "fine-tune a model (the default config, or --config, plus overrides)"),
    "predict": ("finetune.predict", "classify texts or a file with a trained model"),
    "score": ("finetune.score", "metrics and a confusion matrix of a trained model on a labelled file"),
    "plot": ("finetune.plot", "draw a run's curves.png from its train_log.jsonl, or several runs' side by side"),
    "sweep": ("finetune.sweep", "search the config for the best run (Optuna), or run it over seeds"),
}


def usage() -> str:
    lines = ["usage: finetune COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "finetune COMMAND --help for a command's arguments; "
              "finetune train --data reviews.csv --text sentence --label sentiment trains on your own file; "
              "finetune --version"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the command's own entry point; returns its exit code."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from finetune import __version__

        print(f"finetune {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command.startswith("-") and command not in ("-", "--"):
        from finetune.errors import near_option

        near = near_option(command.partition("=")[0], ["--help", "--version"])
        if near:  # the command's own option mistyped (--verison), not one of train's typed without the command
            print(f"error: {command}: not an option of finetune{near}\nhint: finetune --help lists the commands",
                  file=sys.stderr)
            return 2
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"error: unknown command {command!r}{hint}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        if command.startswith("-") or "=" in command:  # train's options or settings, typed without the command
            print(f"hint: the command comes first: finetune train {shlex.join(argv)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
