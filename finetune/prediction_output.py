"""What ``finetune predict`` writes: the predictions file, and the line that sums a file's predictions up.

``--output`` writes ``.csv``, ``.tsv``, ``.jsonl``, ``.parquet`` or ``.xlsx``: each input row with its prediction added
(:func:`write_predictions`). Once a file is classified, one line on stderr says how many texts each label was
given, beside the label's share of the run's validation texts (:func:`predictions_summary`): a model answering
one class for nearly everything, or a file whose texts are not like the training data's, shows there before
anyone opens the file.
"""

from __future__ import annotations

import collections
import csv
import json
import os
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from finetune.prediction_files import OUTPUT_FORMATS, PREDICTED, STDIN, checked_suffix
from finetune.text_encoding import inner_suffix

# past this many labels the line names the most given of them, and counts the rest
SUMMARY_LABELS = 10


def output_separator(file: Optional[str], encoding: str) -> str:
    """The field separator of a ``--output`` CSV: the ``--file``'s own where that is a semicolon-separated
    ``.csv`` (a spreadsheet in a language with a decimal comma opens it in columns), else the comma."""
    from finetune.local_files import csv_separator

    if file is None or file == STDIN or inner_suffix(Path(file)) != ".csv":
        return ","
    return csv_separator(Path(file), encoding)


def _cell(value: Any) -> Any:
    """An input column's value as a CSV field: a list or a mapping (a JSON file's list of labels) as JSON, which
    reads back, where the csv module would write Python's ``['a', 'b']``."""
    return json.dumps(value, ensure_ascii=False, default=str) if isinstance(value, (list, dict)) else value


def write_predictions(path: str | os.PathLike, rows: list[dict[str, Any]], labels: Sequence[str],
                      label_delimiter: str = ",", prefix: str = "", separator: str = ",") -> None:
    """Write predicted rows as ``.csv`` (fields between ``separator``), ``.tsv`` (between tabs, a field that
    holds a tab, a line break or a quote quoted as CSV quotes it, which the readers of training data read back),
    ``.parquet``, ``.xlsx`` or ``.jsonl``.

    A CSV holds the input's columns, then what was predicted: ``label``,
    ``score`` and ``prob_<label>`` per label (single label); ``labels``
    joined by ``label_delimiter`` and ``prob_<label>`` (multi-label);
    ``score`` (regression); each after ``prefix`` (:data:`CLASH_PREFIX` or none).
    A Parquet file holds the same columns, a multi-label ``labels`` as a list; a workbook the CSV's, each
    number a number (:mod:`finetune.workbooks`).
    A JSON line holds the row's dict as it is.
    """
    path = Path(path)
    suffix = checked_suffix(path, OUTPUT_FORMATS, "--output")
    if suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as fh:
            for row in rows:
                # a Parquet file's dates and times are written as their text, as the CSV writer does
                fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        return
    table = _prediction_table(rows, labels, prefix)
    label_list = f"{prefix}labels"
    if suffix == ".parquet":
        _write_parquet(path, table)
        return
    if suffix == ".xlsx":
        from finetune.workbooks import write_workbook  # beside datasets, which texts on a command line do without

        write_workbook(path, {name: [label_delimiter.join(v) if name == label_list and v is not None else _cell(v)
                                     for v in values] for name, values in table.items()})
        return
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, delimiter="\t" if suffix == ".tsv" else separator)
        writer.writerow(list(table))
        for values in zip(*table.values()):
            writer.writerow([label_delimiter.join(v) if name == label_list else _cell(v)
                             for name, v in zip(table, values)])


def _prediction_table(rows: list[dict[str, Any]], labels: Sequence[str], prefix: str) -> dict[str, list[Any]]:
    """The rows as columns: the input's, then ``label``, ``labels``, ``score`` (those predicted) and a
    ``prob_<label>`` per label, each after ``prefix``."""
    added = {f"{prefix}{name}" for name in PREDICTED}
    columns = [c for c in rows[0] if c not in added]
    predicted = [f"{prefix}{c}" for c in ("label", "labels", "score") if f"{prefix}{c}" in rows[0]]
    table = {c: [row[c] for row in rows] for c in columns + predicted}
    if f"{prefix}probabilities" in rows[0]:
        for name in labels:
            table[f"{prefix}prob_{name}"] = [row[f"{prefix}probabilities"][name] for row in rows]
    return table


def _write_parquet(path: Path, table: dict[str, list[Any]]) -> None:
    """``table`` as a Parquet file; a column of the input whose values Arrow cannot hold as one type (numbers and
    texts in one JSON column) is written as their texts, as the CSV writer writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {}
    for name, values in table.items():
        try:
            arrays[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[name] = pa.array([None if v is None else str(_cell(v)) for v in values], type=pa.string())
    pq.write_table(pa.table(arrays), path)


# --------------------------------------------------------------------------- the line that sums them up


def print_predictions(rows: list[dict[str, Any]]) -> None:
    """Predicted rows on stdout, a JSON line each (dates and times as their text, as the CSV writer writes them)."""
    for row in rows:
        print(json.dumps(row, ensure_ascii=False, default=str))


def predictions_summary(rows: list[dict[str, Any]], predictor, prefix: str, output_dir: str | os.PathLike,
                        output: Optional[str] = None) -> str:
    """How many of ``rows`` (predicted by :func:`~finetune.prediction_files.predict_rows` with ``predictor``, a
    :class:`finetune.predictor.Predictor`) each label was given, most given first, each with its share of the
    predicted texts and, where the run's ``metrics.json`` has it, its share of the run's validation texts
    (:func:`validation_shares`); for regression, the scores' range and mean. Empty texts, which get no
    prediction, are counted apart; ``output``, the file written, ends the line.
    """
    problem_type = predictor.problem_type
    filled = [row for row in rows if not _unpredicted(row, problem_type, prefix)]
    empty = len(rows) - len(filled)
    said = f"{len(filled):,} text{'s' if len(filled) != 1 else ''} predicted"
    if filled and problem_type == "regression":
        scores = [row[f"{prefix}score"] for row in filled]
        said += f": scores from {min(scores):.4g} to {max(scores):.4g}, mean {statistics.fmean(scores):.4g}"
    elif filled:
        if problem_type == "multi_label":
            given = collections.Counter(name for row in filled for name in row[f"{prefix}labels"])
        else:
            given = collections.Counter(row[f"{prefix}label"] for row in filled)
        counts = {name: given[name] for name in predictor.labels}  # one pass over the rows, however many labels
        said += ": " + _label_counts(counts, len(filled), validation_shares(output_dir, problem_type))
        if problem_type == "multi_label":
            none = sum(not row[f"{prefix}labels"] for row in filled)
            said += f"; no label {none:,} ({none / len(filled):.1%})"
    if empty:
        said += f"; {empty:,} empty text{'s' if empty != 1 else ''}, not predicted"
    return said + (f" -> {output}" if output else "")


def _unpredicted(row: dict[str, Any], problem_type: str, prefix: str) -> bool:
    """Whether ``row`` holds the empty prediction of an empty text (``Predictor.empty_prediction``)."""
    if problem_type == "regression":
        return row[f"{prefix}score"] is None
    return all(p is None for p in row[f"{prefix}probabilities"].values())


def _label_counts(counts: dict[str, int], texts: int, validation: Optional[dict[str, float]]) -> str:
    """``ham 4,210 (86.6%; validation 86.9%), spam 652 (13.4%; validation 13.1%)``, most given first."""
    ranked = sorted(counts.items(), key=lambda item: -item[1])  # a stable sort: ties stay in the labels' order
    parts = []
    for name, count in ranked[:SUMMARY_LABELS]:
        share = f"{count / texts:.1%}"
        if validation is not None and name in validation:
            share += f"; validation {validation[name]:.1%}"
        parts.append(f"{name} {count:,} ({share})")
    rest = len(ranked) - SUMMARY_LABELS
    if rest > 0:
        given = sum(count for _, count in ranked[SUMMARY_LABELS:])
        parts.append(f"and {rest} more label{'s' if rest != 1 else ''} {given:,} ({given / texts:.1%})")
    return ", ".join(parts)


def validation_shares(output_dir: str | os.PathLike, problem_type: str) -> Optional[dict[str, float]]:
    """Each label's share of the run's validation texts, from its ``metrics.json`` (its final evaluation's
    ``support`` by label): of all the labels given (one class per text) or of the texts (several labels per
    text). None for a folder without one (a model not trained here), a run without validation texts, or
    regression."""
    from finetune.outputs import METRICS_FILE

    if problem_type == "regression":
        return None
    try:
        summary = json.loads((Path(output_dir) / METRICS_FILE).read_text(encoding="utf-8"))
        support = {name: scores["support"] for name, scores in summary["eval_by_label"].items()}
        texts = summary["eval"]["num_samples"] if problem_type == "multi_label" else sum(support.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return {name: count / texts for name, count in support.items()} if texts else None
