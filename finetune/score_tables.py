"""What ``finetune score`` prints of a model's scores: the confusion matrix, or the pairs most confused where
the labels are too many for a terminal's width, each label's scores, and a thresholded model's operating points."""

from __future__ import annotations

from typing import Any, Sequence


def format_confusion(matrix, names: Sequence[str]) -> str:
    """The confusion matrix as an aligned text table (rows: true, columns: predicted)."""
    names = [str(n) for n in names]
    width = max([len(n) for n in names] + [len(str(int(matrix.max()))) if matrix.size else 1, 4])
    head = " " * (width + 2) + " ".join(n.rjust(width) for n in names)
    rows = [f"{name.ljust(width)}  " + " ".join(str(int(v)).rjust(width) for v in row)
            for name, row in zip(names, matrix)]
    return "\n".join(["confusion matrix (rows: true label, columns: predicted label)", head, *rows])


# past this many labels a printed matrix is wider than a terminal: the pairs most confused are printed instead
PRINTED_MATRIX_LABELS = 12


def format_confusions(matrix, names: Sequence[str], top: int = 10) -> str:
    """The ``top`` most frequent mistakes (a true label read as another), most frequent first."""
    off = sorted(((int(matrix[i, j]), str(names[i]), str(names[j])) for i in range(len(names))
                  for j in range(len(names)) if i != j and matrix[i, j] > 0), key=lambda item: -item[0])
    lines = [f"  {true} -> {predicted}: {count}" for count, true, predicted in off[:top]]
    return "\n".join([f"most confused (true label -> predicted label: texts; {len(off)} pairs in all)", *lines]
                     if off else ["most confused: no text was given another label"])


# the ranking metrics' columns, where a label's scores hold them, and their headings
RANKED_COLUMNS = {"roc_auc": "roc_auc", "average_precision": "avg_precision"}


def format_by_label(by_label: dict[str, dict[str, float]]) -> str:
    """Each label's scores as an aligned text table, one row per label."""
    width = max([len(str(name)) for name in by_label] + [5])
    first = next(iter(by_label.values()), {})
    # the probability a label passed: every label's (multi-label), or the positive class's of two
    over = any("threshold" in s for s in by_label.values())
    ranked = {key: head for key, head in RANKED_COLUMNS.items() if key in first}
    head = (f"{'label'.ljust(width)}  precision  recall      f1  support  predicted"
            + "".join(f"  {heading}" for heading in ranked.values()) + "  threshold" * over)
    rows = [f"{str(name).ljust(width)}  {s['precision']:9.4f}  {s['recall']:6.4f}  {s['f1']:6.4f}  {s['support']:7d}"
            f"  {s['predicted']:9d}" + "".join(f"  {s[key]:{len(heading)}.4f}" for key, heading in ranked.items())
            + (f"  {s['threshold']:9.3g}" if "threshold" in s else " " * 11 * over) for name, s in by_label.items()]
    return "\n".join(["by label (each scored alone; support: its texts in the file; predicted: the texts given it)",
                      head, *rows])


def format_operating_points(points: dict[str, list[dict[str, Any]]]) -> str:
    """A model's operating points as aligned text (``points``: rows by label, from
    :func:`finetune.metrics.label_points`): a two-class model's positive class in full, a multi-label model's
    labels one row each."""
    if len(points) == 1:
        (positive, rows), = points.items()
        return _one_label_points(positive, rows)
    return _labels_points(points)


def _one_label_points(positive: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"{positive}'s threshold for a precision or recall of {positive} on this file "
             f"(finetune predict --threshold T, evaluation.threshold=T)",
             f"{'aim':<17}  threshold  precision  recall      f1  predicted"]
    for row in rows:
        if row["threshold"] is None:
            lines.append(f"{row['aim']:<17}  {'none reaches it':>9}")
            continue
        lines.append(f"{row['aim']:<17}  {row['threshold']:9.4g}  {row['precision']:9.4f}  {row['recall']:6.4f}  "
                     f"{row['f1']:6.4f}  {row['predicted']:9d}")
    return "\n".join(lines)


def _labels_points(points: dict[str, list[dict[str, Any]]]) -> str:
    """One row per label: the threshold of each aim, with what it keeps of the other measure in brackets (the
    recall at a precision, the precision at a recall); ``--json`` holds each row in full."""
    aims = [row["aim"] for row in next(iter(points.values()))[1:]]  # the first row is the model's threshold
    cells = {name: [_kept(row) for row in rows[1:]] for name, rows in points.items()}
    width = max([len(name) for name in points] + [5])
    cell = max(len(text) for row in cells.values() for text in row)
    precisions = sum(aim.startswith("precision") for aim in aims)  # their columns first, then the recalls'

    def line(first: str, texts: list[str]) -> str:
        return (first.ljust(width) + "  " + "  ".join(t.rjust(cell) for t in texts[:precisions]) + "    "
                + "  ".join(t.rjust(cell) for t in texts[precisions:])).rstrip()

    span = (cell + 2) * precisions - 2
    return "\n".join([
        "each label's threshold for a precision or recall of it on this file, with (in brackets) the recall or "
        "precision kept",
        "(finetune predict --threshold \"{label: T, ...}\" or evaluation.threshold; none: no threshold reaches it)",
        (" " * width + "  " + "precision >=".center(span) + "    " + "recall >=".center(span)).rstrip(),
        line("label", [aim.split()[-1] for aim in aims]),
        *(line(name, texts) for name, texts in cells.items())])


def _kept(row: dict[str, Any]) -> str:
    """An aim's threshold and, in brackets, the recall it keeps (a precision's aim) or the precision (a recall's)."""
    if row["threshold"] is None:
        return "none"
    other = row["recall"] if row["aim"].startswith("precision") else row["precision"]
    return f"{row['threshold']:.3g} ({other:.2f})"
