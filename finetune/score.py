"""Score a fine-tuned model on a labelled file: ``finetune score`` (or ``python -m finetune.score``).

Usage::

    finetune score outputs/sms_spam --file held_out.tsv   # read like the training file
    finetune score outputs/sms_spam --file test.csv       # a CSV whose header names text and label
    finetune score outputs/bbc_news --file test.csv evaluation.metrics=[accuracy] --json scores.json

The file is read as training read its data: with the ``data`` settings of the run's saved ``config.yaml`` (format,
header, column names, empty texts), which ``data.key=value`` arguments override; a folder, a JSON Lines, JSON or
Parquet file, and a CSV/TSV file whose first line names the run's text and label columns, are read by their own layout
instead of the run's format and column names. Labels are matched to the model's by name; a label the model was not
trained on is an error naming its row. The metrics are the run's ``evaluation`` settings (those of validation during
training), each with its 95% bootstrap interval, plus the loss, and each label's precision, recall, F1 and support
scored alone; for a single-label model a confusion matrix is printed (past 12 labels, the pairs most confused instead)
and written as a PNG (by default ``<output_dir>/confusion_<file name>.png``). Multi-label and regression models are
scored with their own metrics and loss (see :mod:`finetune.tasks`), without a confusion matrix, and regression without
the labels' table. ``--against`` scores a second run's model on the same texts (:mod:`finetune.comparison`). A
thresholded model predicts at its thresholds unless ``evaluation.threshold`` gives others (a number, or by label name);
its operating points say where each could go (:mod:`finetune.metrics.operating_points`).

(Not named ``evaluate``: a module of that name would hide the ``evaluate`` library for ``accelerate launch``.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from finetune.errors import CommandParser, ConfigError, DataError, FileLayoutError, out_of_memory_told_as, run_command
# --precision's argument and check come through predict, which shares them (finetune.precisions)
from finetune.predict import (DEFAULT_BATCH_SIZE, Predictor, add_precision_argument, batch_too_large,
                              check_precision, quiet_progress_bars, saved_config)

_SCORE_SECTIONS = ("data", "evaluation")
# The labelled file is the only data: no second file, no carve, no caps.
_DATA_FIXED = {"dataset_name": None, "validation_file": None, "validation_split": 0.0, "validation_folds": None,
               "validation_fold": 1, "max_train_samples": None, "max_eval_samples": None}


@dataclass
class Score:
    """What :func:`score_file` measured."""

    file: str
    # {"loss", "num_samples", <metric>: value} as in evaluate_model's results
    metrics: dict[str, float]
    # class names in class-id order (the model's)
    labels: list[str]
    # confusion[i][j]: samples of true class i predicted as class j (single-label models; else None)
    confusion: Any
    predictions: Any
    references: Any
    # the forward passes' arithmetic: "no" (float32), "bf16" or "fp16"
    precision: str = "no"
    # each label's precision, recall, F1 and support, by name (finetune.metrics.scores_by_label), and a multi-label
    # model's threshold; None for a regression model
    by_label: Optional[dict[str, dict[str, float]]] = None
    # the file's rows whose text (with its pair) a training row of the run has too; None where the run's
    # training rows could not be read again (see texts_seen_in_training)
    seen_in_training: Optional[int] = None
    # each built-in metric's 95% bootstrap interval over the file's texts (finetune.metrics.intervals)
    intervals: Optional[dict[str, list[float]]] = None
    # what was scored, and with what (for a comparison): the file's texts and pairs, the run's MetricSuite
    texts: Any = None
    pairs: Any = None
    suite: Any = None
    # each text's probability of each label, where the metrics rank the texts by them (ROC AUC, average precision)
    scores: Any = None
    # each label's thresholds for target precisions and recalls, {label: rows}: a two-class model's positive
    # class's, or every label's of a multi-label model (finetune.metrics.operating_points)
    operating_points: Optional[dict[str, list]] = None

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "precision": self.precision, "metrics": self.metrics, "labels": self.labels,
                "by_label": self.by_label, "seen_in_training": self.seen_in_training, "intervals": self.intervals,
                "confusion_matrix": None if self.confusion is None else self.confusion.tolist(),
                "operating_points": self.operating_points}


def scoring_config(output_dir: str | os.PathLike, file: str | os.PathLike, overrides: Sequence[str] = ()):
    """The run's saved config with ``data`` pointed at ``file`` and ``overrides`` applied.

    Without a saved ``config.yaml`` the schema's defaults apply (format from
    the extension, columns ``text`` and ``label``, accuracy and macro f1).

    Raises:
        ConfigError: for an override outside ``data.*`` / ``evaluation.*`` or an invalid value.
    """
    from finetune.config import FILE_LAYOUT_KEYS, PER_LABEL, config_from_dict, parse_override, read_yaml
    from finetune.outputs import CONFIG_FILE

    path = Path(output_dir) / CONFIG_FILE
    raw = read_yaml(path) if path.is_file() else {}
    data = dict(raw.get("data") or {})
    data.update(_DATA_FIXED, train_file=str(file))
    tree = {"data": data, "evaluation": dict(raw.get("evaluation") or {}),
            # what the run trained decides how its labels are read (a list, a delimited string, a number)
            "model": {"problem_type": (raw.get("model") or {}).get("problem_type", "single_label")}}
    given = set()
    for text in overrides:
        key, value = parse_override(text)
        section, _, name = key.partition(".")
        if section not in _SCORE_SECTIONS or not name or "." in name:
            raise ConfigError(f"override {text!r}: scoring reads only data.<key> and evaluation.<key> settings")
        if section == "data" and name in (*_DATA_FIXED, "train_file"):
            raise ConfigError(f"override {text!r}: the file to score is --file")
        tree[section][name] = value
        given.add(key)
    if tree["model"]["problem_type"] != "regression" and "evaluation.threshold" not in given:
        tree["evaluation"]["threshold"] = PER_LABEL  # the model's own, whatever the run's setting was
    columns = [tree["data"].get("text_column", "text"), tree["data"].get("label_column", "label")]
    if _own_layout(file, columns, str(tree["data"].get("encoding") or "utf-8")):
        # the run's format, header and column names described its training file; this file names its columns.
        # Its encoding stays the run's: a header names columns, not how the bytes are written
        for key in FILE_LAYOUT_KEYS:
            if f"data.{key}" not in given and key != "encoding":
                tree["data"].pop(key, None)
    return config_from_dict(tree, source=f"{path} with --file {file}" if path.is_file() else f"--file {file}")


def _own_layout(file: str | os.PathLike, columns: Sequence[str], encoding: str = "utf-8") -> bool:
    """Whether the file says its own layout: a folder (of classes, or saved by datasets), a JSON Lines, JSON or
    Parquet file (its keys), or a CSV/TSV file whose first line names all of ``columns``."""
    import csv

    from finetune.resources import data_path
    from finetune.text_encoding import inner_suffix, open_text

    path = data_path(str(file), "--file")  # a URL's downloaded copy
    if path.is_dir() or inner_suffix(path) in (".jsonl", ".json", ".parquet"):
        return True
    if inner_suffix(path) not in (".csv", ".tsv", ".tab") or not path.is_file():
        return False
    try:
        with open_text(path, encoding, errors="replace") as fh:
            first = fh.readline()
    except (LookupError, UnicodeError, DataError):  # an unknown encoding, no text in it, damaged: the read says
        return False
    fields = next(csv.reader([first], delimiter="\t" if "\t" in first else ","), [])
    return set(columns) <= {f.strip() for f in fields}


def _layout_hint(data_cfg) -> Optional[str]:
    """How the file was read, when that came from the run's config rather than from the file itself."""
    layout = [f"format: {data_cfg.format}"] if data_cfg.format != "auto" else []
    if data_cfg.column_names:
        layout += ["no header", f"columns {', '.join(data_cfg.column_names)}"]
    return (f"read as the run's data was ({'; '.join(layout)}); a CSV/TSV file whose header names "
            f"{data_cfg.text_column!r} and {data_cfg.label_column!r} is read by its header, or set "
            f"data.format, data.has_header and data.column_names") if layout else None


def load_labelled(file: str | os.PathLike, data_cfg, labels: Sequence[str], problem_type: str = "single_label"):
    """Texts and class ids of a labelled file, read with ``finetune.data``'s readers. Unlike training data, the
    file may hold fewer classes than the model knows: its labels are looked up among the model's ``labels``.

    Returns:
        ``(texts, text_pairs or None, class ids)``.

    Raises:
        DataError: naming the file and row for unreadable data, empty texts
            (unless ``data.on_empty_text: drop``) and labels the model does not have.
    """
    from finetune import data as fdata

    label_space = fdata.LabelSpace(list(labels), problem_type)
    return fdata.labelled_columns(fdata.load_labelled_file(str(file), data_cfg, label_space, key="--file"))


def threshold_given(setting, problem_type: str, names: Sequence[str]) -> Union[None, float, dict[str, float]]:
    """``evaluation.threshold`` as scoring takes it: ``None`` for the model's own (``per_label``, which
    :func:`scoring_config` sets where none is given), else the number, or the thresholds by label name, given.

    Raises:
        ConfigError: for a threshold given to a single-label model of more than two classes, or one for a name
            that is not the model's label, before its weights are loaded.
    """
    from finetune.tasks import refuse_threshold

    if isinstance(setting, str) or problem_type == "regression":
        return None
    try:
        refuse_threshold(setting, problem_type, names)
    except ValueError as exc:
        raise ConfigError(f"evaluation.threshold: {exc}") from None
    return setting


def texts_seen_in_training(output_dir: str | os.PathLike, texts: Sequence[str],
                           pairs: Optional[Sequence[str]] = None) -> Optional[int]:
    """How many of ``texts`` (with their ``pairs``) the run in ``output_dir`` trained on.

    The run's training rows are read again as it read them: from its local training file with its saved
    ``config.yaml`` (the path as given, from the current folder, else the absolute path its ``metrics.json``
    holds), and taken only where they are the rows it trained on (the SHA-256 its ``metrics.json`` holds).
    ``None`` where they cannot be: a Hub data set or a URL, a file moved or edited since, a run saved without them.
    """
    import dataclasses

    from finetune.data import content_sha256, text_rows
    from finetune.errors import FinetuneError
    from finetune.outputs import METRICS_FILE
    from finetune.resources import resolve_path

    try:
        cfg = saved_config(output_dir)
        record = json.loads((Path(output_dir) / METRICS_FILE).read_text(encoding="utf-8"))["train"]
        trained_sha = record["data_sha256"]
        given = cfg.data.train_file if cfg is not None else None
        # the path as given is found from the folder the run started in, its absolute path from any other; a URL's
        # file is not downloaded again to be read
        paths = [path for path in dict.fromkeys((given, record.get("data_file") if given else None))
                 if path is not None and Path(resolve_path(path)).exists()]
    except (FinetuneError, OSError, ValueError, KeyError, TypeError):
        return None
    for path in paths:
        data = dataclasses.replace(cfg.data, train_file=path)
        if data.validation_file:  # without it the run's training rows are the same: a validation file is never carved
            data = dataclasses.replace(data, validation_file=None, validation_split=0.0)
        train = training_rows(data, cfg)
        if train is not None and content_sha256(train) == trained_sha:
            trained = set(text_rows(train))
            rows = zip(texts, pairs) if pairs is not None else ((text,) for text in texts)
            return sum(row in trained for row in rows)
    return None


def training_rows(data, cfg):
    """The training split ``load_splits`` reads with ``data`` and the run's seed, quietly; None where it cannot."""
    from finetune.data import load_splits
    from finetune.errors import FinetuneError

    said = logging.getLogger("finetune")
    level = said.level
    said.setLevel(logging.ERROR)  # what the run's start said of its data (rows dropped, say) is not this file's
    try:
        return load_splits(data, cfg.split_seed, cfg.model.problem_type)[0]["train"]
    except FinetuneError:
        return None
    finally:
        said.setLevel(level)


def score_file(output_dir: str | os.PathLike, file: str | os.PathLike, overrides: Sequence[str] = (),
               batch_size: int = DEFAULT_BATCH_SIZE, predictor: Optional[Predictor] = None,
               precision: str = "no", count_seen: bool = True) -> Score:
    """The configured metrics, the loss and the confusion matrix of a run's model on a labelled file.

    Args:
        output_dir: The run's output directory (model and ``config.yaml``).
        file: Labelled data in any format training reads.
        overrides: ``data.key=value`` / ``evaluation.key=value`` settings.
        batch_size: Texts per forward pass.
        predictor: An already loaded :class:`~finetune.predict.Predictor` (default: load from ``output_dir``).
        precision: The forward passes' arithmetic when loading: ``no`` (float32), ``bf16`` or ``fp16``. A
            bf16 run evaluated under bf16 autocast: scored in bf16 in the evaluation's batches, its loss in
            ``metrics.json`` comes back to the last digit.
        count_seen: Count the file's texts that the run trained on (:func:`texts_seen_in_training`, which reads
            the run's training rows again); ``False`` leaves ``Score.seen_in_training`` ``None``.

    Raises:
        FinetuneError: one line naming the file, row or key for bad input.
    """
    import numpy as np
    import torch

    from finetune.metrics import confusion_matrix, label_points, metric_intervals, metric_suite_for, scores_by_label
    from finetune.tasks import model_labels

    cfg = scoring_config(output_dir, file, overrides)
    # read the file before loading the weights: bad data fails fast
    if predictor is not None:
        names, problem_type = predictor.labels, predictor.problem_type
    else:
        names, problem_type = model_labels(output_dir)
    try:
        texts, pairs, references = load_labelled(file, cfg.data, names, problem_type)
    except FileLayoutError as exc:
        # the run's layout, where the file was read with it, is the likelier cause than what a file read by its
        # own header is told
        raise FileLayoutError(exc.message, _layout_hint(cfg.data) or exc.hint) from None
    counts = np.bincount(np.asarray(references), minlength=len(names)) if problem_type == "single_label" else None
    suite = metric_suite_for(cfg.evaluation, names, problem_type, counts, whose="the model")
    threshold = threshold_given(cfg.evaluation.threshold, problem_type, names)

    predictor = predictor or Predictor.load(output_dir, batch_size=batch_size, precision=precision)
    task = predictor.task if threshold is None else predictor.task_at(threshold)
    logits = torch.from_numpy(predictor.logits(texts, pairs, progress=True))
    refs = torch.as_tensor(np.asarray(references))
    predictions = task.predictions(logits).numpy()
    # each text's probabilities, once: ROC AUC and average precision order the texts by them, and the
    # operating points read a two-class model's positive class's, or each label's
    probabilities = task.probabilities(logits).numpy() if problem_type != "regression" else None
    scores = {"scores": probabilities} if getattr(suite, "ranking", None) else {}
    # the loss evaluate_model reports: the mean per-sample loss of the problem type on float32 logits
    loss = task.per_sample_loss(logits, refs).double().mean().item()
    metrics = {"loss": loss, "num_samples": len(texts), **suite.compute(predictions, refs.numpy(), **scores)}
    confusion = confusion_matrix(refs.numpy(), predictions, len(names)) if problem_type == "single_label" else None
    by_label = (scores_by_label(predictions, refs.numpy(), names, ranking=suite.ranking, **scores)
                if problem_type != "regression" else None)
    for name, value in task.thresholds_by_label(names).items():
        by_label[name]["threshold"] = value  # what each label was predicted over
    return Score(str(file), metrics, list(names), confusion, predictions, refs.numpy(), predictor.precision,
                 by_label, texts_seen_in_training(output_dir, texts, pairs) if count_seen else None,
                 metric_intervals(suite, predictions, refs.numpy(), **scores), texts, pairs, suite,
                 scores.get("scores"),
                 label_points(task, probabilities, refs.numpy(), names, getattr(suite, "pos_label", None)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="finetune score", description="Score a fine-tuned model on a labelled file.")
    parser.add_argument("output_dir", help="a run's output directory (the saved model and config.yaml)")
    parser.add_argument("--file", required=True, help="labelled data: csv, tsv, json/jsonl, parquet, a class folder "
                        "or a folder datasets saved, on disk, at a URL or in a .zip or .tar.gz (contest.zip/test.csv)")
    parser.add_argument("--text", metavar="COLUMN", help="column of the texts (data.text_column; default: the run's)")
    parser.add_argument("--text-pair", metavar="COLUMN", help="column of the second texts of sentence pairs "
                        "(data.text_pair_column; default: the run's)")
    parser.add_argument("--label", metavar="COLUMN", help="column of the labels (data.label_column; default: the "
                        "run's)")
    parser.add_argument("--png", default=None,
                        help="confusion-matrix PNG to write (default: <output_dir>/confusion_<file name>.png)")
    parser.add_argument("--json", default=None,
                        help="also write the metrics, each label's scores and the matrix to this JSON file")
    parser.add_argument("--against", metavar="OTHER_RUN", help="also score another run's model on the same texts, "
                        "and each metric's difference with its 95%% paired bootstrap interval")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="texts per forward pass")
    add_precision_argument(parser)
    parser.add_argument("--no-overlap-check", dest="count_seen", action="store_false",
                        help="do not read the run's training rows again to count the file's texts it trained on "
                             "(about 3 s per 300,000 training rows)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="data.* / evaluation.* settings replacing the run's")
    # intermixed: settings may come before or after the options
    args = parser.parse_intermixed_args(argv)
    # the flags of `finetune train --data`, as the settings they stand for
    flags = (("text_column", args.text), ("text_pair_column", args.text_pair), ("label_column", args.label))
    columns = [f"data.{key}={value}" for key, value in flags if value]
    args.overrides = columns + list(args.overrides)
    return args


def run(args: argparse.Namespace) -> Score:
    """Check the arguments, score, print and write the outputs."""
    from finetune.outputs import json_ready, refuse_a_run_file, require_saved_model
    from finetune.resources import data_name, data_path, file_name

    output_dir = require_saved_model(args.output_dir)
    other_dir = require_saved_model(args.against, "--against") if args.against else None
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    check_precision(args.precision, "--precision")
    data_path(args.file, "--file")  # there, or downloaded where it is a URL
    png = Path(args.png) if args.png else output_dir / f"confusion_{data_name(args.file)}.png"
    for flag, target in (("--png", png), ("--json", Path(args.json) if args.json else None)):
        if target is not None:
            refuse_a_run_file(target, output_dir, flag)
            if not target.resolve().parent.is_dir():
                raise DataError(f"{flag} {target}: its directory does not exist")
    # after the checks above, which need neither datasets nor torch (seconds to import): a wrong argument
    # is said at once
    from finetune.comparison import check_comparable
    from finetune.metrics import metrics_with_intervals
    from finetune.tasks import model_labels
    from finetune.plot import DPI, confusion_figure, picture_format
    from finetune.score_tables import (PRINTED_MATRIX_LABELS, format_by_label, format_confusion, format_confusions,
                                       format_operating_points)

    png_format = picture_format(png, "--png")  # before the scoring, which may take minutes
    if other_dir is not None:  # before anything is scored: a model that answers another question is said at once
        check_comparable(*model_labels(output_dir), *model_labels(other_dir), other_dir)
    quiet_progress_bars()  # the bars of reading the file and loading the weights; the scoring bar is ours
    with out_of_memory_told_as(lambda _: batch_too_large(args.batch_size)):
        result = score_file(output_dir, args.file, args.overrides, args.batch_size, precision=args.precision,
                            count_seen=args.count_seen)
    arithmetic = f", computed in {result.precision} autocast" if result.precision != "no" else ""
    seen = f", {result.seen_in_training} of them a text the model trained on" if result.seen_in_training else ""
    print(f"{result.file}: {result.metrics['num_samples']} samples{seen}{arithmetic}")
    print(metrics_with_intervals(result.metrics, result.intervals or {}))
    if result.by_label is not None:
        print(format_by_label(result.by_label))
    if result.operating_points is not None:
        print(format_operating_points(result.operating_points))
    for caution in cautions(result, f"texts of {file_name(args.file)}"):
        print(f"warning: {caution}", file=sys.stderr)
    if result.confusion is not None:
        if len(result.labels) <= PRINTED_MATRIX_LABELS:
            print(format_confusion(result.confusion, result.labels))
        else:
            print(format_confusions(result.confusion, result.labels))
        title = f"{output_dir.name} on {file_name(args.file)}"
        confusion_figure(result.confusion, result.labels, title=title).savefig(png, dpi=DPI, format=png_format)
        print(f"confusion matrix: {png}")
    report = result.to_dict()
    if other_dir is not None:
        from finetune.comparison import score_against

        report["against"] = score_against(result, other_dir, args.batch_size, args.precision).to_dict()
    if args.json:
        Path(args.json).write_text(json.dumps(json_ready(report), indent=2) + "\n", encoding="utf-8")
    return result


def cautions(result: Score, texts_named: str) -> list[str]:
    """What in the scores is worth a warning: a model that gave every text one answer (or, for regression, one
    number), or targets all alike, over which a correlation is undefined."""
    from finetune.data import SEEN_IN_TRAINING_AT_MOST
    from finetune.metrics import correlations_over_alike_targets, one_number_for_every_text, same_answer_for_every_text

    if result.by_label is not None:  # classes
        said = [same_answer_for_every_text(result.by_label, result.metrics.get("num_samples"), texts_named,
                                           "the model")]
    else:
        said = [correlations_over_alike_targets(result.metrics, result.references, texts_named),
                one_number_for_every_text(result.metrics, result.references, texts_named, "the model")]
    rows = result.metrics.get("num_samples", 0)
    if result.seen_in_training and result.seen_in_training > SEEN_IN_TRAINING_AT_MOST * rows:
        said.append(f"{result.seen_in_training} of the {rows} {texts_named} are texts the model trained on: their "
                    f"scores say what it remembers, not how it does on texts it has not seen")
    return [caution for caution in said if caution is not None]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 for bad input)."""
    args = parse_args(argv)
    return run_command(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
