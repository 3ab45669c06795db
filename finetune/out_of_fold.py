"""Out-of-fold predictions: after a sweep's folds, each fold's model on the rows it was held out from.

K-fold cross-validation predicts every row once, by the one model that did
not train on it. Those predictions in one file are what error analysis reads
(a row whose held-out prediction disagrees with its label, confidently, is
the first to check for a wrong label) and what a model stacked on this one
trains on. ``finetune sweep --folds K`` writes them to
``folds/predictions.csv`` once every fold's run has finished: the fold, the
text (and its pair), the row's label, then the prediction's columns as
``finetune predict --output`` writes them, each prefixed ``predicted_``.

Each fold's held-out rows are cut again from its saved ``config.yaml``, as
its run cut them, and its saved model predicts them in float32, as
``finetune score`` would on a file of those rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from finetune.outputs import CONFIG_FILE, saved_config
from finetune.prediction_files import CLASH_PREFIX, predict_rows
from finetune.prediction_output import write_predictions

OUT_OF_FOLD_FILE = "predictions.csv"


def write_out_of_fold(folder: Path, runs: dict[int, Path]) -> Optional[Path]:
    """``folder/predictions.csv`` from each fold's run (``runs``: each fold's run folder), or ``None`` while a
    fold's run has not saved its model. Written aside and renamed into place, so that a reader (or another worker
    writing the same file) never meets half of it."""
    from finetune.predictor import Predictor

    if not all((run / CONFIG_FILE).is_file() and (run / "config.json").is_file() for run in runs.values()):
        return None
    rows: list[dict[str, Any]] = []
    labels, delimiter = [], ","
    for fold, run in runs.items():
        cfg = saved_config(run)
        predictor = Predictor.load(run)
        held_out = held_out_rows(cfg, fold)
        pair = "text_pair" if held_out and "text_pair" in held_out[0] else None
        rows += predict_rows(predictor, held_out, "text", pair, prefix=CLASH_PREFIX)
        labels, delimiter = predictor.labels, cfg.data.label_delimiter or ","
        del predictor  # one fold's model in memory at a time
    path = folder / OUT_OF_FOLD_FILE
    aside = path.with_name(f".{os.getpid()}.{path.name}")  # its suffix names its format
    write_predictions(aside, rows, labels, delimiter, CLASH_PREFIX)
    os.replace(aside, path)
    return path


def held_out_rows(cfg, fold: int) -> list[dict[str, Any]]:
    """The rows a fold's run validated on, as its config cuts them: the fold, the text (and its pair) and the
    label, by name (several labels joined by ``data.label_delimiter``, else ",", as the predicted ones are, or a
    0/1 column each where the file has them; the number for regression)."""
    from finetune.columns import read_column
    from finetune.data import LABELS, TEXT, TEXT_PAIR, load_splits

    splits, label_space = load_splits(cfg.data, seed=cfg.split_seed, problem_type=cfg.model.problem_type)
    held_out = splits["validation"]
    columns = {"text": read_column(held_out, TEXT)}
    if TEXT_PAIR in held_out.column_names:
        columns["text_pair"] = read_column(held_out, TEXT_PAIR)
    labels = [label_of(value, label_space) for value in read_column(held_out, LABELS)]
    if isinstance(cfg.data.label_column, list) and cfg.data.label_map is None:  # a 0/1 column per label, as read
        columns.update({name: [int(name in names) for names in labels] for name in label_space.names})
    elif label_space.problem_type == "multi_label":  # joined as the predicted labels beside them are
        columns["label"] = [(cfg.data.label_delimiter or ",").join(names) for names in labels]
    else:
        columns["label"] = labels
    return [{"fold": fold, **dict(zip(columns, values))} for values in zip(*columns.values())]


def label_of(value, label_space) -> Any:
    """A row's encoded label as the file would name it: a class id's name, a 0/1 vector's names, a number."""
    if label_space.problem_type == "single_label":
        return label_space.names[int(value)]
    if label_space.problem_type == "multi_label":
        return [name for name, on in zip(label_space.names, value) if on >= 0.5]
    return float(value)
