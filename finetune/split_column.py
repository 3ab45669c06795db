"""A training file with a column that names each row's split (``train``, ``validation``, ``test``):
``data.split_column``.

One file holding every split is a common way to pass a labelled set around
(a data set exported to one CSV, a spreadsheet with a column of the rows'
roles). Read as it is, each of its rows trains, the test rows too, and the
scores of the validation rows carved from them say nothing of texts the model
has not seen. With ``data.split_column`` its rows are told apart as a Hub data
set's splits are, by ``data.train_split``, ``data.validation_split_name`` and
``data.test_split_name``, each split keeping the file's line numbers for the
errors that name its rows. A column that looks like one (every value a usual
name of a split) where the setting is not given is warned of.
"""

from __future__ import annotations

import logging
from typing import Optional

import datasets
import numpy as np
import pyarrow.compute as pc

from finetune.errors import DataError, FileLayoutError
from finetune.resources import file_name
from finetune.tables import Table, as_arrow, column_values

logger = logging.getLogger("finetune.data")

# the names data sets give their splits, in lower case: a column of these alone names each row's split
SPLIT_NAMES = frozenset({"train", "training", "test", "testing", "validation", "valid", "val", "dev", "development",
                         "eval", "evaluation", "holdout"})


def rows_by_split(table: Table, column: str) -> dict[str, Table]:
    """``table``'s rows by their value in ``column`` (the spaces around it are not part of it), each split in
    the order its first row comes. A row without a split is an error naming it."""
    if column not in table.ds.column_names:
        raise FileLayoutError(f"{table.source}: no column {column!r} (data.split_column); columns found: "
                              f"{', '.join(table.ds.column_names)}")
    names = [split_name(value) for value in column_values(table.ds, column)]
    missing = [i for i, name in enumerate(names) if name is None]
    if missing:
        raise DataError(f"{table.source}: {len(missing)} row{'s' if len(missing) > 1 else ''} without a split in "
                        f"column {column!r} ({table.where_many(missing)}; data.split_column)")
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        rows.setdefault(name, []).append(i)
    return {name: table.keep(np.asarray(where)) for name, where in rows.items()}


def split_name(value) -> Optional[str]:
    """A row's split as its column writes it (training's and ``finetune predict --split``'s one rule): the spaces
    around it are not part of it, and an empty one names none."""
    return None if value is None else str(value).strip() or None


def named_split(spec: str, split: str) -> str:
    """A split of the file ``spec`` as the run names it (its test set): ``all.csv[test]``."""
    return f"{file_name(spec)}[{split}]"


def say_splits_left_out(splits: dict[str, Table], used: set[str], column: str) -> None:
    """Say in one line the rows of the splits the run neither trains, validates nor tests on."""
    left = {name: len(split.ds) for name, split in splits.items() if name not in used}
    if not left:
        return
    source = next(iter(splits.values())).source
    said = " and ".join(f"{count} row{'' if count == 1 else 's'} of split {name!r}" for name, count in left.items())
    test = next((name for name in left if name.lower() in ("test", "testing")), None)
    scores = f"; data.test_split_name={test} scores its rows after training" if test else ""
    logger.info("%s: left out %s, which the run neither trains, validates nor tests on (data.split_column: %s%s)",
                source, said, column, scores)


def warn_of_a_split_column(table: Table, used: list[str]) -> None:
    """Warn where a column of the training file, not one of ``used``, names each row's split while
    ``data.split_column`` is not set: every row trains, its test rows too."""
    found = _split_like(table, used)
    if found is None:
        return
    column, names = found
    train = next((name for name in names if name.lower() in ("train", "training")), None)
    others = " and ".join(repr(name) for name in names if name != train)
    if train is None:
        setting = f"data.split_column={column} with data.train_split naming the training rows' split"
    else:
        setting = (f"data.split_column={column}{'' if train == 'train' else f' data.train_split={train}'} trains on "
                   f"the {train!r} rows alone")
    logger.warning("%s: column %r names each row's split (%s), yet every row trains, the %s rows too; %s",
                   table.source, column, ", ".join(names), others, setting)


def _split_like(table: Table, used: list[str]) -> Optional[tuple[str, list[str]]]:
    """The first column, not one of ``used``, whose every value is a usual name of a split, two names or more, one
    of them not a training split's: its name and its values, sorted."""
    texts = [name for name, feature in table.ds.features.items() if name not in used
             and isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")]
    if not texts:
        return None
    arrow = as_arrow(table.ds.select_columns(texts))  # the texts to train on are not copied to be looked at
    for column, values in zip(arrow.column_names, arrow.columns):
        names = sorted({name.strip() for name in pc.unique(values).to_pylist() if name is not None})
        if (len(names) >= 2 and all(name.lower() in SPLIT_NAMES for name in names)
                and any(name.lower() not in ("train", "training") for name in names)):
            return column, names
    return None
