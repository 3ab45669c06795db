"""Classify texts with a fine-tuned model: ``python -m finetune.predict``.

Usage::

    python -m finetune.predict outputs/sms_spam "WIN a free prize, call now" "see you at lunch"
    python -m finetune.predict outputs/sms_spam --file messages.txt --output predictions.csv
    accelerate launch --multi_gpu --num_processes 8 -m finetune.predict outputs/sms_spam --file big.csv --output p.csv

Each prediction has the label (the most probable class; for two classes, the positive class where its probability is
over a threshold: the model's, or ``--threshold``), its probability (``score``) and every class's; for a multi-label
model, ``labels`` (every label whose sigmoid probability is over its threshold: the model's, or ``--threshold``) and
each label's probability; for a regression model, the number (``score``). Texts given on the command line print as
JSON lines; ``--file`` reads what training reads (and ``.txt``, a text per line unless its lines split on tabs alike,
as a table's; ``-``, standard input) and writes one row per input row, in order, its columns kept and the prediction
added (docs/inference.md). The model runs where training would (a GPU if there is one), in float32 unless
``--precision`` asks for autocast, on batches of similar length, each text cut and padded as the run did (its saved
``config.yaml``). The same folder works in plain ``transformers.pipeline("text-classification", model=output_dir)``.
A folder of runs (a sweep's ``folds/``) predicts with their models averaged (:mod:`finetune.ensemble`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.errors import (CommandParser, ConfigError, OutOfMemory, notes_to_stderr, out_of_memory_told_as,
                             run_command)
from finetune.ensemble import load_predictor, refuse_the_runs_files, saved_runs
from finetune.outputs import saved_config
from finetune.precisions import add_precision_argument, check_precision
from finetune.prediction_files import (STDIN, check_options, file_kind, local_file, note_the_files_own_columns,
                                       predict_rows, prediction_prefix, read_rows, ONE_TEXT_EACH, TEXT_FOLDER)
from finetune.prediction_output import output_separator, predictions_summary, print_predictions, write_predictions
from finetune.predictor import DEFAULT_BATCH_SIZE, Predictor  # noqa: F401 (finetune.predictor.Predictor, as before)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="finetune predict", description="Classify texts with a fine-tuned model.")
    parser.add_argument("output_dir", help="a run's output directory (the saved model), or a folder of runs whose "
                        "models average (a sweep's folds/)")
    parser.add_argument("texts", nargs="*", help="texts to classify (printed as JSON lines)")
    parser.add_argument("--file", default=None, help="classify the texts of a .txt, .csv, .tsv, .json(l), .parquet "
                        "or .xlsx file, a folder of .txt files (a text each) or one datasets saved, on disk, at a URL "
                        "or in a .zip or .tar.gz (contest.zip/test.csv) (-: one text per line from standard input)")
    parser.add_argument("--sheet", default=None, help="the sheet of an .xlsx --file to classify (default: the first)")
    parser.add_argument("--split", metavar="NAME", help="classify one split of the --file alone: the rows whose "
                        "column of splits holds NAME, or a split of a folder datasets saved")
    parser.add_argument("--split-column", metavar="COLUMN", help="the --file's column of splits (default: the "
                        "run's data.split_column)")
    parser.add_argument("--output", help="write the predictions to a .csv, .tsv, .parquet, .xlsx or .jsonl")
    parser.add_argument("--text", "--text-column", dest="text_column", metavar="COLUMN", default=None,
                        help="CSV column / JSON key of the text (default: the run's data.text_column)")
    parser.add_argument("--encoding", default=None, help="text encoding of the --file (cp1252, latin-1, ...; "
                        "default: the run's data.encoding)")
    parser.add_argument("--quoting", choices=("auto", "csv", "none"), help="how a CSV or TSV --file's quotes read "
                        "(default: the run's data.quoting)")
    parser.add_argument("--text-pair", "--text-pair-column", dest="text_pair_column", metavar="COLUMN", default=None,
                        help="column of the second text, for models trained on pairs (default: the run's)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="texts per forward pass")
    parser.add_argument("--threshold", default=None, help="multi-label models: predict every label whose "
                        "probability is over this; two classes: the positive class (the run's "
                        "evaluation.positive_label) where its probability is over this, else the other; or by label "
                        "name: \"{toxic: 0.3, insult: 0.6}\" (default: the model's, evaluation.threshold's, else "
                        "the most probable class)")
    add_precision_argument(parser)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    # intermixed: texts may come before or after the options
    return parser.parse_intermixed_args(argv)


def quiet_progress_bars(files: bool = True) -> None:
    """Silence the bars of loading weights and, with ``files``, of reading one (datasets' import takes a second
    that texts given on the command line do without), for commands that show a bar of their own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if files:
        import datasets
        datasets.disable_progress_bars()


def run(args: argparse.Namespace) -> None:
    """Check every argument, load the model, predict, write. Raises FinetuneError on bad input."""
    check_options(args)
    check_precision(args.precision, "--precision")
    output_dir = Path(args.output_dir)
    runs = saved_runs(output_dir)  # the run, or the runs of a folder of them, whose models average
    # the file last, since a URL's is downloaded first, and an archive unpacked: the copy is what is read
    file = local_file(args.file) if args.file else args.file
    cfg = saved_config(runs[0])
    encoding = args.encoding or (cfg.data.encoding if cfg is not None else "utf-8")
    text_column = args.text_column or (cfg.data.text_column if cfg is not None else "text")
    # a line of a .txt file or standard input, or a folder's file, is a text: the run's text column names a column
    kind = file and (".txt" if file == STDIN else file_kind(file, encoding, text_column, cfg and cfg.data))
    if kind in ONE_TEXT_EACH and args.text_column is not None:
        raise ConfigError(f"--text {args.text_column!r}: names a column; {args.file} holds one text per "
                          f"{'file' if kind == TEXT_FOLDER else 'line'}")
    if args.output:
        if file != STDIN and Path(args.output).resolve() == Path(file).resolve():
            raise ConfigError(f"--output {args.output}: is the --file being classified; name another file")
        refuse_the_runs_files(args.output, runs, "--output")
    text_column = "text" if kind in ONE_TEXT_EACH else text_column
    pair_column = args.text_pair_column or (cfg.data.text_pair_column if cfg is not None else None)
    # after the checks above, which need no transformers and, a .txt file's kind aside, no datasets: said at once
    quiet_progress_bars(files=bool(args.file))  # of reading the file and loading the weights; the file's is ours
    if args.threshold is not None:  # against the model's labels before its weights load, in the option's name
        from finetune.tasks import model_labels, refuse_threshold
        names, problem_type = model_labels(runs[0])
        try:
            refuse_threshold(args.threshold, problem_type, names)
        except ValueError as exc:
            raise ConfigError(f"--threshold: {exc}") from None
    if args.file:
        rows = read_rows(args.file, text_column, pair_column, encoding, args.sheet, args.split, args.split_column,
                         run_data=cfg and cfg.data, kind=kind, quoting=args.quoting or (cfg and cfg.data.quoting))
    else:
        if pair_column:
            raise ConfigError(f"this model takes text pairs ({pair_column!r}): use --file with both columns")
        rows, text_column = [{"text": text} for text in args.texts], "text"
    # under accelerate launch every process reads the same rows and runs a share of their batches; the first
    # process says and writes what one process would
    predictor = load_predictor(output_dir, batch_size=args.batch_size, threshold=args.threshold,
                               precision=args.precision, across_processes=True)
    first = predictor.processes[0] == 0
    prefix, clashes = prediction_prefix(rows, predictor.labels)
    if args.file and first:
        note_the_files_own_columns(args.file, args.output_dir, rows, clashes, prefix,
                                   cfg.data.label_column if cfg is not None else None)
    with out_of_memory_told_as(lambda _: batch_too_large(args.batch_size)):
        predicted = predict_rows(predictor, rows, text_column, pair_column, bool(args.file), prefix, kept=first)
    if not first:
        return
    if args.output:
        delimiter = (cfg.data.label_delimiter if cfg is not None else None) or ","
        write_predictions(args.output, predicted, predictor.labels, delimiter, prefix,
                          separator=output_separator(file, encoding))
    else:
        print_predictions(predicted)
    if args.file:  # a file's predictions summed up in a line, on stderr beside the notes
        print(predictions_summary(predicted, predictor, prefix, runs[0], args.output), file=sys.stderr)


def batch_too_large(batch_size: int) -> OutOfMemory:
    """Out of memory predicting: the ``--batch-size`` that halves the batches (the longest run first, not hours in)."""
    return OutOfMemory(f"out of memory at --batch-size {batch_size}, on the longest texts (they run first)",
                       hint=f"--batch-size {batch_size // 2}" if batch_size > 1 else None)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 for bad input)."""
    args = parse_args(argv)
    notes_to_stderr()  # what reading the --file found, beside the command's own notes
    return run_command(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
