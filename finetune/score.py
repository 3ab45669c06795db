"""Score a fine-tuned model on a labelled file: ``finetune score`` (or ``python -m finetune.score``).

Usage::

    finetune score outputs/sms_spam --file held_out.tsv   # read like the training file
    finetune score outputs/sms_spam --file test.csv       # a CSV whose header names text and label
    finetune score outputs/bbc_news --file test.csv evaluation.metrics=[accuracy] --json scores.json
    finetune score outputs/sms_spam --file test.csv --card   # and into the model card, for the Hub
    accelerate launch --multi_gpu --num_processes 8 -m finetune.score outputs/sms_spam --file test.csv   # 8 GPUs

The file is read as training read its data (:mod:`finetune.scored_files`): with the ``data`` settings of the run's
saved ``config.yaml`` (format, header, column names, empty texts), which ``data.key=value`` arguments override; a
folder, a JSON Lines, JSON or Parquet file, and a CSV/TSV file whose first line names the run's text and label columns,
are read by their own layout instead of the run's format and column names. Labels are matched to the model's by name; a label the model was not
trained on is an error naming its row. The metrics are the run's ``evaluation`` settings (those of validation during
training), each with its 95% bootstrap interval, plus the loss, and each label's precision, recall, F1 and support
scored alone; for a single-label model a confusion matrix is printed (past 12 labels, the pairs most confused instead)
and written as a PNG (by default ``<output_dir>/confusion_<file name>.png``). Multi-label and regression models are
scored with their own metrics and loss (see :mod:`finetune.tasks`), without a confusion matrix, and regression without
the labels' table. ``--against`` scores a second run's model on the same texts (:mod:`finetune.comparison`). A
thresholded model predicts at its thresholds unless ``evaluation.threshold`` gives others (a number, or by label name);
its operating points say where each could go (:mod:`finetune.metrics.operating_points`). ``--card`` adds the
scores to the run's model card (:func:`finetune.model_card.card_with_scores`).

(Not named ``evaluate``: a module of that name would hide the ``evaluate`` library for ``accelerate launch``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from finetune.errors import (CommandParser, ConfigError, DataError, FileLayoutError, notes_to_stderr,
                             out_of_memory_told_as, run_command)
# --precision's argument and check, and a run's or a folder of runs' models, come through predict, which shares
# them (finetune.precisions, finetune.ensemble)
from finetune.predict import (DEFAULT_BATCH_SIZE, Predictor, add_precision_argument, batch_too_large,
                              check_precision, load_predictor, quiet_progress_bars, refuse_the_runs_files, saved_runs)
# the labelled file: its settings, its rows, and its texts the run trained on
from finetune.scored_files import layout_hint, load_labelled, scoring_config, texts_seen_in_training


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
    # a folder of runs scored as one: each model's own scores on the same texts, [{"run", "metrics"}]
    alone: Optional[list[dict[str, Any]]] = None

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "precision": self.precision, "metrics": self.metrics, "labels": self.labels,
                "by_label": self.by_label, "seen_in_training": self.seen_in_training, "intervals": self.intervals,
                "confusion_matrix": None if self.confusion is None else self.confusion.tolist(),
                "operating_points": self.operating_points, "models_alone": self.alone}


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


def score_file(output_dir: str | os.PathLike, file: str | os.PathLike, overrides: Sequence[str] = (),
               batch_size: int = DEFAULT_BATCH_SIZE, predictor: Optional[Predictor] = None,
               precision: str = "no", count_seen: bool = True, across_processes: bool = False,
               split: Optional[str] = None) -> Score:
    """The configured metrics, the loss and the confusion matrix of a run's model on a labelled file.

    Args:
        output_dir: The run's output directory (model and ``config.yaml``).
        file: Labelled data in any format training reads.
        overrides: ``data.key=value`` / ``evaluation.key=value`` settings.
        batch_size: Texts per forward pass.
        predictor: An already loaded :class:`~finetune.predictor.Predictor` (default: load from ``output_dir``).
        precision: The forward passes' arithmetic when loading: ``no`` (float32), ``bf16`` or ``fp16``. A
            bf16 run evaluated under bf16 autocast: scored in bf16 in the evaluation's batches, its loss in
            ``metrics.json`` comes back to the last digit.
        count_seen: Count the file's texts that the run trained on (:func:`texts_seen_in_training`, which reads
            the run's training rows again); ``False`` leaves ``Score.seen_in_training`` ``None``.
        across_processes: Under ``accelerate launch``, each process runs a share of the batches (see
            :class:`~finetune.predictor.Predictor`); every process gets the whole score.
        split: Score that split of the file alone: the rows whose ``data.split_column`` (the run's, or one of
            ``overrides``) holds it, or the split of a folder ``datasets`` saved. The score's file is then named
            ``all.csv[test]``.

    Raises:
        FinetuneError: one line naming the file, row or key for bad input.
    """
    import numpy as np

    from finetune.metrics import metric_suite_for
    from finetune.tasks import model_labels

    runs = saved_runs(output_dir)  # the run, or a folder of runs whose models average (finetune.ensemble)
    cfg = scoring_config(runs[0], file, overrides, split)
    # read the file before loading the weights: bad data fails fast
    if predictor is not None:
        names, problem_type = predictor.labels, predictor.problem_type
    else:
        names, problem_type = model_labels(runs[0])
    try:
        texts, pairs, references = load_labelled(file, cfg.data, names, problem_type)
    except FileLayoutError as exc:
        # the run's layout, where the file was read with it, is the likelier cause than what a file read by its
        # own header is told
        raise FileLayoutError(exc.message, layout_hint(cfg.data) or exc.hint) from None
    counts = np.bincount(np.asarray(references), minlength=len(names)) if problem_type == "single_label" else None
    suite = metric_suite_for(cfg.evaluation, names, problem_type, counts, whose="the model")
    threshold = threshold_given(cfg.evaluation.threshold, problem_type, names)

    predictor = predictor or load_predictor(output_dir, batch_size=batch_size, precision=precision,
                                            across_processes=across_processes)
    seen = texts_seen_in_training(runs, texts, pairs) if count_seen else None
    result = score_texts(predictor, suite, scored_name(str(file), split), texts, pairs, references, threshold, seen)
    if getattr(predictor, "alone", None):  # a folder of runs' models: what each scores alone beside their mean
        result.alone = models_alone(predictor.alone, suite, references)
    return result


def models_alone(alone, suite, references: Sequence) -> list[dict[str, Any]]:
    """Each model of an ensemble scored alone on the texts their mean was scored on, at its own thresholds:
    ``alone`` is :attr:`finetune.ensemble.Ensemble.alone` (each run, its logits, its task); the loss and
    ``suite``'s metrics of each, as :func:`score_logits` computes them of one model."""
    import numpy as np
    import torch

    refs = torch.as_tensor(np.asarray(references))
    return [{"run": str(run), "metrics": decided_and_measured(task, suite, torch.from_numpy(logits), refs)[2]}
            for run, logits, task in alone]


def scored_name(file: str, split: Optional[str]) -> str:
    """What a score calls the texts it scored: the file, or its split (``all.csv[test]``)."""
    return f"{file}[{split}]" if split is not None else file


def score_texts(predictor: Predictor, suite, name: str, texts: Sequence[str], pairs: Optional[Sequence[str]],
                references: Sequence, threshold=None, seen: Optional[int] = None, progress: bool = True) -> Score:
    """What :func:`score_file` measures, on labelled texts already read: ``suite`` (a
    :class:`~finetune.metrics.MetricSuite`) and the loss of ``predictor``'s model at ``threshold`` (``None``: its
    own thresholds), each label's scores, the confusion matrix and the operating points. ``name`` and ``seen``
    (the texts the model trained on, or ``None``: not looked for) are what the :class:`Score` reports them as;
    ``progress`` shows a bar of the texts scored."""
    logits = predictor.logits(texts, pairs, progress=progress)
    return score_logits(predictor, suite, name, texts, pairs, references, logits, threshold, seen)


def score_logits(predictor: Predictor, suite, name: str, texts: Sequence[str], pairs: Optional[Sequence[str]],
                 references: Sequence, logits, threshold=None, seen: Optional[int] = None) -> Score:
    """:func:`score_texts` of the texts' ``logits`` (a float32 array, a row per text, as
    :meth:`Predictor.logits` gives them), computed already: by several processes, a share each (a run's test
    set)."""
    import numpy as np
    import torch

    from finetune.metrics import confusion_matrix, label_points, metric_intervals, scores_by_label

    names, problem_type = predictor.labels, predictor.problem_type
    task = predictor.task if threshold is None else predictor.task_at(threshold)
    refs = torch.as_tensor(np.asarray(references))
    predictions, probabilities, measured = decided_and_measured(task, suite, torch.from_numpy(logits), refs)
    scores = {"scores": probabilities} if getattr(suite, "ranking", None) else {}
    metrics = {"loss": measured["loss"], "num_samples": len(texts), **measured}
    confusion = confusion_matrix(refs.numpy(), predictions, len(names)) if problem_type == "single_label" else None
    by_label = (scores_by_label(predictions, refs.numpy(), names, ranking=suite.ranking, **scores)
                if problem_type != "regression" else None)
    for label, value in task.thresholds_by_label(names).items():
        by_label[label]["threshold"] = value  # what each label was predicted over
    return Score(name, metrics, list(names), confusion, predictions, refs.numpy(), predictor.precision,
                 by_label, seen, metric_intervals(suite, predictions, refs.numpy(), **scores), texts, pairs, suite,
                 scores.get("scores"),
                 label_points(task, probabilities, refs.numpy(), names, getattr(suite, "pos_label", None)))


def decided_and_measured(task, suite, logits, refs) -> tuple[Any, Any, dict[str, float]]:
    """A model's decisions of ``logits`` (a float32 tensor, a row per text) at ``task``, each text's probabilities
    (None for regression), and the loss ``evaluate_model`` reports (the mean per-sample loss of the problem type)
    with ``suite``'s metrics of the decisions against ``refs``."""
    predictions = task.predictions(logits).numpy()
    # each text's probabilities, once: ROC AUC and average precision order the texts by them, and the
    # operating points read a two-class model's positive class's, or each label's
    probabilities = task.probabilities(logits).numpy() if task.problem_type != "regression" else None
    scores = {"scores": probabilities} if getattr(suite, "ranking", None) else {}
    loss = task.per_sample_loss(logits, refs).double().mean().item()
    return predictions, probabilities, {"loss": loss, **suite.compute(predictions, refs.numpy(), **scores)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="finetune score", description="Score a fine-tuned model on a labelled file.")
    parser.add_argument("output_dir", help="a run's output directory (the saved model and config.yaml), or a folder "
                        "of runs whose models average (a sweep's folds/)")
    parser.add_argument("--file", required=True, help="labelled data: csv, tsv, json/jsonl, parquet, xlsx, a class "
                        "folder or a folder datasets saved, on disk, at a URL or in a .zip or .tar.gz "
                        "(contest.zip/test.csv)")
    parser.add_argument("--text", metavar="COLUMN", help="column of the texts (data.text_column; default: the run's)")
    parser.add_argument("--text-pair", metavar="COLUMN", help="column of the second texts of sentence pairs "
                        "(data.text_pair_column; default: the run's)")
    parser.add_argument("--label", metavar="COLUMN", help="column of the labels (data.label_column; default: the "
                        "run's)")
    parser.add_argument("--split", metavar="NAME", help="score one split of the file alone: the rows whose column "
                        "of splits (the run's data.split_column, or data.split_column=...) holds NAME, or a split of "
                        "a folder datasets saved")
    parser.add_argument("--png", default=None,
                        help="confusion-matrix PNG to write (default: <output_dir>/confusion_<file name>.png)")
    parser.add_argument("--json", default=None,
                        help="also write the metrics, each label's scores and the matrix to this JSON file")
    parser.add_argument("--card", action="store_true", help="also add the scores to the run's model card "
                        "(README.md: its model-index, which the Hub shows, and a section); a file scored again "
                        "replaces its scores")
    parser.add_argument("--against", metavar="OTHER_RUN", help="also score another run's model (or a folder of "
                        "runs') on the same texts, and each metric's difference with its 95%% paired bootstrap "
                        "interval")
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
    from finetune.model_card import card_of, card_with_scores
    from finetune.errors import is_main_rank
    from finetune.outputs import json_ready, write_atomic
    from finetune.resources import data_name, data_path, file_name

    output_dir, runs = Path(args.output_dir), saved_runs(args.output_dir)
    other_dir = Path(args.against) if args.against else None
    others = saved_runs(other_dir, "--against") if other_dir else []
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    check_precision(args.precision, "--precision")
    data_path(args.file, "--file")  # there, or downloaded where it is a URL
    split = f"-{args.split}" if args.split else ""  # a file's split scored alone: confusion_all-test.png
    png = Path(args.png) if args.png else output_dir / f"confusion_{data_name(args.file)}{split}.png"
    named = scored_name(file_name(args.file), args.split)
    if args.card and len(runs) > 1:
        raise ConfigError(f"--card: {output_dir} holds {len(runs)} runs, and a model card is one run's; score one "
                          f"of them with --card, or leave out --card")
    card = card_of(output_dir) if args.card else None
    if card and any(setting.startswith("evaluation.threshold=") for setting in args.overrides):
        raise ConfigError("--card: the card holds the model's results at its own thresholds, which "
                          "evaluation.threshold replaces; give one of the two")
    for flag, target in (("--png", png), ("--json", Path(args.json) if args.json else None)):
        if target is not None:
            refuse_the_runs_files(target, runs, flag)
            refuse_the_runs_files(target, others, flag)
            if not target.resolve().parent.is_dir():
                raise DataError(f"{flag} {target}: its directory does not exist")
    # after the checks above, which need neither datasets nor torch (seconds to import): a wrong argument
    # is said at once
    from finetune.comparison import check_comparable
    from finetune.tasks import model_labels
    from finetune.plot import picture_format

    png_format = picture_format(png, "--png")  # before the scoring, which may take minutes
    if other_dir is not None:  # before anything is scored: a model that answers another question is said at once
        check_comparable(*model_labels(runs[0]), *model_labels(others[0]), other_dir)
    quiet_progress_bars()  # the bars of reading the file and loading the weights; the scoring bar is ours
    # under accelerate launch every process scores a share of the batches, and the first reports for all
    first = is_main_rank()
    with out_of_memory_told_as(lambda _: batch_too_large(args.batch_size)):
        result = score_file(output_dir, args.file, args.overrides, args.batch_size, precision=args.precision,
                            count_seen=args.count_seen and first, across_processes=True, split=args.split)
    report = result.to_dict()
    if other_dir is not None:
        from finetune.comparison import format_comparison, score_against

        comparison = score_against(result, other_dir, args.batch_size, args.precision, across_processes=True)
        report["against"] = comparison.to_dict()
    if not first:
        return result
    print_score(result, named, f"{output_dir.name} on {named}", png, png_format)
    if other_dir is not None:
        print(format_comparison(result, comparison, len(result.texts)))
    if args.json:
        Path(args.json).write_text(json.dumps(json_ready(report), indent=2) + "\n", encoding="utf-8")
    if card:
        write_atomic(card, card_with_scores(card.read_text(encoding="utf-8"), output_dir.name, named,
                                            result.metrics, result.by_label, result.seen_in_training,
                                            result.intervals, result.precision))
        print(f"model card: {card}")
    return result


def models_alone_in_words(alone: list[dict[str, Any]]) -> str:
    """A line of each metric's range over an ensemble's models scored alone, and their mean: what the average of
    the models does beside each of them."""
    said = []
    for name in alone[0]["metrics"]:
        values = [model["metrics"][name] for model in alone]
        said.append(f"{name} {min(values):.4f} to {max(values):.4f} (mean {sum(values) / len(values):.4f})")
    return f"each of the {len(alone)} models alone: {', '.join(said)}"


def print_score(result: Score, file_named: str, title: str, png: Path, png_format: str) -> None:
    """What ``finetune score`` says of a file's scores: the metrics with their intervals, each label's scores and
    operating points, the cautions (on stderr), and the confusion matrix, which it also draws into ``png`` under
    ``title``."""
    from finetune.metrics import averaging_in_words, metrics_with_intervals
    from finetune.plot import DPI, confusion_figure
    from finetune.score_tables import (PRINTED_MATRIX_LABELS, format_by_label, format_confusion, format_confusions,
                                       format_operating_points)

    arithmetic = f", computed in {result.precision} autocast" if result.precision != "no" else ""
    seen = f", {result.seen_in_training} of them a text the model trained on" if result.seen_in_training else ""
    averaging = averaging_in_words(result.suite, result.labels) if result.suite is not None else None
    averaged = f"; {averaging}" if averaging else ""
    print(f"{result.file}: {result.metrics['num_samples']} samples{seen}{arithmetic}{averaged}")
    print(metrics_with_intervals(result.metrics, result.intervals or {}))
    if result.alone:
        print(models_alone_in_words(result.alone))
    if result.by_label is not None:
        print(format_by_label(result.by_label))
    if result.operating_points is not None:
        print(format_operating_points(result.operating_points))
    for caution in cautions(result, f"texts of {file_named}"):
        print(f"warning: {caution}", file=sys.stderr)
    if result.confusion is not None:
        if len(result.labels) <= PRINTED_MATRIX_LABELS:
            print(format_confusion(result.confusion, result.labels))
        else:
            print(format_confusions(result.confusion, result.labels))
        confusion_figure(result.confusion, result.labels, title=title).savefig(png, dpi=DPI, format=png_format)
        print(f"confusion matrix: {png}")


def cautions(result: Score, texts_named: str) -> list[str]:
    """What in the scores is worth a warning: a model that gave every text one answer (or, for regression, one
    number), or targets all alike, over which a correlation is undefined."""
    from finetune.data import SEEN_IN_TRAINING_AT_MOST
    from finetune.metrics import (MetricSuite, averaged_over_absent_labels, correlations_over_alike_targets,
                                  one_number_for_every_text, same_answer_for_every_text)

    if result.by_label is not None:  # classes
        said = [same_answer_for_every_text(result.by_label, result.metrics.get("num_samples"), texts_named,
                                           "the model")]
        suite = result.suite
        if suite is not None:
            single = isinstance(suite, MetricSuite)  # else several labels to a text
            positive = result.labels[suite.pos_label] if single and suite.pos_label is not None else None
            said.append(averaged_over_absent_labels(
                suite.names, suite.average, positive, {name: s["support"] for name, s in result.by_label.items()},
                texts_named.replace("texts", "text", 1), labels=not single))
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
    notes_to_stderr()  # what reading the --file found, beside the command's own notes
    return run_command(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
