"""Fine-tune a BERT-family classifier: ``accelerate launch finetune/train.py``.

Usage::

    accelerate launch finetune/train.py --config configs/default.yaml [section.key=value ...]
    accelerate launch -m finetune.train --config configs/bbc_news.yaml training.seed=1
    finetune train --data reviews.csv --text sentence --label sentiment --output outputs/reviews

With no ``--config``, ``configs/default.yaml`` is used. Bad input (config,
data, model, launch) ends with one line on stderr and exit code 2; pass
``--debug`` (or set ``FINETUNE_DEBUG=1``) for the traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # `accelerate launch finetune/train.py` puts finetune/ itself first on sys.path, where its
    # modules would be importable under bare names; import them as the `finetune` package instead.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
from typing import Iterator  # noqa: E402

from finetune.errors import (  # noqa: E402
    CommandParser, ConfigError, FinetuneError, is_main_rank, library_bars_seldom_into_a_file, log_to_stderr,
    out_of_memory_told_as, run_command)

logger = logging.getLogger("finetune")


EXAMPLES = """examples:
  finetune train --data reviews.csv --text sentence --label sentiment --output outputs/reviews
  finetune train --data reviews.csv --model microsoft/deberta-v3-base --output outputs/reviews-deberta
  finetune train --config configs/bbc_news.yaml training.max_steps=50 optim.learning_rate=3e-5
  finetune train --data tagged.jsonl --label tags --output outputs/tags model.problem_type=multi_label
  finetune train --explain training.effective_batch_size
  accelerate launch --multi_gpu --num_processes 4 -m finetune.cli train --data reviews.csv"""


def epilog() -> str:
    """The keys of every section (from the schema), examples, and where each key is explained."""
    from finetune.config_reference import cli_keys

    return (f"config keys, by section (section.key=value; --explain section.key for one):\n{cli_keys()}\n\n"
            f"{EXAMPLES}\n\nevery key: docs/configuration.md")


# the short path's flags and the keys they set
SHORTCUTS = {"data": "data.train_file", "validation": "data.validation_file", "test": "data.test_file",
             "text": "data.text_column", "text_pair": "data.text_pair_column", "label": "data.label_column",
             "model": "model.name_or_path", "output": "output.output_dir"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(
        prog="finetune train",
        description="Fine-tune a BERT-family text classifier with exact gradient accumulation.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    parser.add_argument("--data", metavar="FILE", help="training data: CSV, TSV, JSON Lines (or those as "
                        ".gz, .bz2, .xz), Parquet, an Excel workbook (.xlsx; data.sheet names a sheet), on disk or "
                        "at a URL; a class folder or a folder datasets saved; "
                        "any of them in a .zip or .tar.gz (spam.zip, contest.zip/train.csv) (sets data.train_file; "
                        "its layout is found from the file)")
    add_held_out_options(parser)
    add_column_options(parser)
    parser.add_argument("--model", metavar="NAME", help="the pretrained encoder: a Hub id (microsoft/deberta-v3-base) "
                        "or a local folder (model.name_or_path)")
    parser.add_argument("--output", metavar="DIR", help="where the run writes (output.output_dir)")
    parser.add_argument("--explain", metavar="SECTION.KEY", help="print one config key's type, default and meaning, "
                        "then exit")
    parser.add_argument("--dry-run", action="store_true", help="build and check the run, say its start line, train "
                        "a few updates and evaluate once to measure them, say how long the whole run would take, and "
                        "write nothing to the output folder")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted config overrides")
    args, args.unknown = parser.parse_known_intermixed_args(argv)
    args.options = parser.options  # for the one a mistyped option is near
    args.overrides = shortcut_overrides(args, SHORTCUTS) + list(args.overrides)
    return args


def add_held_out_options(parser: argparse.ArgumentParser) -> None:
    """The options that name the validation and test files, which ``finetune train`` and ``finetune sweep`` share."""
    parser.add_argument("--validation", metavar="FILE", help="validation data, in the training data's layout "
                        "(data.validation_file; without it data.validation_split of the training rows is held out)")
    parser.add_argument("--test", metavar="FILE", help="test data, in the training data's layout, scored once by the "
                        "saved model after training (data.test_file)")


def add_column_options(parser: argparse.ArgumentParser) -> None:
    """The options that name the data's columns, which ``finetune train`` and ``finetune sweep`` share."""
    parser.add_argument("--text", metavar="COLUMN", help="column of the texts (data.text_column)")
    parser.add_argument("--text-pair", metavar="COLUMN", help="column of the second texts of sentence pairs "
                        "(data.text_pair_column)")
    parser.add_argument("--label", metavar="COLUMN", help="column of the labels (data.label_column); multi_label "
                        "also reads a 0/1 column per label: --label \"[toxic, insult]\"")


# the settings that name the data, or the folder named for it
NAMING_KEYS = ("data.train_file=", "data.dataset_name=", "data.dataset_config=", "output.output_dir=")


def shortcut_overrides(args: argparse.Namespace, flags) -> list[str]:
    """The short path's ``flags`` that ``args`` has, as the settings they stand for.

    With other data on a shipped config (the default, or another of the package's
    ``configs/``) and no output folder named, the run writes to
    ``outputs/<the data's name>``: a shipped config's folder is named for its own
    data set, which the command line replaced, and a second data set trained
    into it would meet the first one's run there. A config of one's own names its folder.
    """
    from finetune.config import is_shipped

    given = [f"{SHORTCUTS[flag]}={getattr(args, flag)}" for flag in flags if getattr(args, flag)]
    settings = naming_settings([*given, *args.overrides])
    named = "output.output_dir" in settings
    replaced = replacing_data_name(settings)
    if replaced and is_shipped(args.config) and not named:
        given.append(f"output.output_dir=outputs/{replaced}")
    return given


def naming_settings(overrides: list[str]) -> dict:
    """The values ``overrides`` give the keys of ``NAMING_KEYS``; one the config's checks will refuse is left out
    here, so that they refuse it in their one line."""
    from finetune.config import parse_override

    settings = {}
    for override in overrides:
        if override.startswith(NAMING_KEYS):
            with contextlib.suppress(ConfigError):
                key, value = parse_override(override)
                settings[key] = value
    return settings


def replacing_data_name(settings: dict) -> str | None:
    """The name of the data that command-line ``settings`` put in the config's place, or None where they left it.

    A file is named as ``resources.data_name`` names it (``reviews`` for
    ``reviews.csv``); a Hub data set by its name's last part and, where the
    command line chose one, its configuration (``glue-sst2``, ``imdb``; ``cola``
    for ``data.dataset_config=cola`` alone on a config that names glue).
    """
    from finetune.resources import data_name

    def text(key: str) -> str | None:
        value = settings.get(key)
        return value if isinstance(value, str) and value.strip() else None

    if text("data.train_file"):
        return data_name(text("data.train_file")) or "data"
    hub, subset = text("data.dataset_name"), text("data.dataset_config")
    if hub is None and subset is None:
        return None
    return "-".join(part for part in (hub and hub.rstrip("/").rsplit("/", 1)[-1], subset) if part)


def _name_origin(exc: FinetuneError, config_path: str | None, overrides: list[str]) -> None:
    """Put where the key at fault came from in front of a message that starts with that key.

    Checks made after loading (a data file that is missing, the batch split
    over the launched processes, the data's labels, the model's limits) know
    the key, not where it was set: the command line, or the YAML file and its
    line (``load_config`` does the same for its own checks).
    """
    from finetune.config import Config, origin_of

    keys = tuple(f"{f.name}." for f in dataclasses.fields(Config))
    if exc.message.startswith(keys):
        exc.message = f"{origin_of(exc.message, config_path, overrides)}: {exc.message}"


def run_training(config_path: str | None, overrides: list[str], on_evaluation=None, dry_run: bool = False) -> dict:
    """Load the config, build the run, train it. Returns the metrics summary.

    ``on_evaluation`` is :func:`finetune.fitting.fit`'s callback (a sweep's pruner). With ``dry_run`` the run
    is built and tried for a few updates and an evaluation instead (:func:`finetune.rehearsal.rehearse`), nothing
    is written to its folder, and the summary is ``{"rehearsal": the Rehearsal}``.

    What is logged comes in the run's order: notes on the config, the start
    line (:func:`finetune.start_line.describe`) once every input is checked,
    then the progress. The whole config goes to the output folder's
    ``config.yaml`` and, with ``--debug``, to the log.
    """
    import yaml

    from finetune.accumulation import resolve_batching
    from finetune.config import load_config
    from finetune.launch import launched_world_size
    from finetune.output_dir import check_output_dir

    # the config, the output folder and the batch's split are checked before torch and transformers are
    # imported, which takes seconds: a mistyped key or a folder that must not be written is said at once
    cfg = load_config(config_path, overrides)
    if is_main_rank():
        logger.debug("the config of this run:\n%s", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    try:
        # a path mistyped first: the folder's check would otherwise name the typo as another run's setting
        check_inputs_exist(cfg)
        check_output_dir(cfg)
        # k is decided here, once, for the processes the launcher started (build_accelerator checks that they
        # all joined): a batch they cannot split is refused before anything is built
        batching = resolve_batching(cfg.training, launched_world_size())
        is_main, summary = build_and_fit(cfg, batching, on_evaluation, dry_run)
    except FinetuneError as exc:
        _name_origin(exc, config_path, overrides)
        raise
    if is_main and summary.get("eval"):
        from finetune.start_line import done_line  # torch with it, which the checks above must not import

        logger.info(done_line(summary, cfg.output.output_dir))
    return summary


def check_inputs_exist(cfg) -> None:
    """The local model, tokenizer and data files the config names are there, in the order the run reads them.

    A path mistyped is the commonest first error, so it is looked for before torch and transformers are
    imported; what is there is read, and checked further, when the run loads it. A Hub id or a Hub data set
    is looked up then.
    """
    from finetune.resources import data_path, model_location

    model = cfg.model
    if model.tokenizer_name_or_path:
        model_location(model.tokenizer_name_or_path, "model.tokenizer_name_or_path", tokenizer=True)
    model_location(model.name_or_path, "model.name_or_path")
    for key in ("train_file", "validation_file", "test_file"):
        spec = getattr(cfg.data, key)
        if spec is not None:
            data_path(spec, f"data.{key}")


def build_and_fit(cfg, batching, on_evaluation=None, dry_run: bool = False) -> tuple[bool, dict]:
    """Join the processes, build the run, say what it will do and train it (or, with ``dry_run``, try it).
    Returns (main process?, summary)."""
    from finetune.assembly import setup_run
    from finetune.fitting import fit
    from finetune.launch import build_accelerator
    from finetune.out_of_memory import out_of_memory_error
    from finetune.rehearsal import rehearse
    from finetune.start_line import dry_run_line, say

    quiet_library_progress()
    accelerator = build_accelerator(cfg)  # refuses a launch whose processes did not all join
    with data_progress(shown=cfg.logging.progress_bar and accelerator.is_main_process):
        run = setup_run(cfg, accelerator, batching)
        say(run)
        with out_of_memory_told_as(lambda exc: out_of_memory_error(run, exc, dry_run)):
            if dry_run:
                rehearsal = rehearse(run)
                if accelerator.is_main_process:
                    logger.info(dry_run_line(run, rehearsal))
                return accelerator.is_main_process, {"rehearsal": rehearsal}
            return accelerator.is_main_process, fit(run, on_evaluation=on_evaluation)


def quiet_library_progress() -> None:
    """No progress bars of transformers' own (loading and writing weights) in the command's log.

    Each takes a second or less and leaves a bar line between the log's lines;
    the run's own bar shows its progress. Notebooks keep transformers' default.
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


@contextlib.contextmanager
def data_progress(shown: bool) -> Iterator[None]:
    """``datasets``' progress bars (a file read into a split, a split tokenized) where ``shown``, else none until
    the block ends.

    They are the run's progress while its data is prepared, which on a large file takes minutes; but
    ``logging.progress_bar: false`` asks for a log without bars, and under a launch every process would draw its
    own copy of each. ``HF_DATASETS_DISABLE_PROGRESS_BARS``, where set, decides instead.
    """
    import datasets
    import datasets.config

    hide = (not shown and datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is None
            and datasets.is_progress_bar_enabled())
    if hide:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if hide:  # as it was for what the caller does next (a notebook, a sweep's next trial)
            datasets.enable_progress_bars()


def explain(key: str) -> int:
    """``--explain section.key``: print the key's reference; exit code 2 for a key the schema lacks."""
    from finetune.config import unknown_key_hint  # key_hints' own, through config: one package import fewer
    from finetune.config_reference import key_help

    try:
        print(key_help(key))
        return 0
    except KeyError:
        print(f"error: --explain {key}: no such config key{unknown_key_hint(key)}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.unknown:
        from finetune.config import refuse_options  # key_hints' own, through config: one package import fewer

        return run_command(lambda: refuse_options(args.unknown, argv, "finetune train", SHORTCUTS, args.options),
                           debug=args.debug)
    if args.explain:
        return explain(args.explain)
    library_bars_seldom_into_a_file()  # before anything imports tqdm
    log_to_stderr()
    if args.debug and is_main_rank():
        logger.setLevel(logging.DEBUG)
    return run_command(lambda: run_training(args.config, args.overrides, dry_run=args.dry_run), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
