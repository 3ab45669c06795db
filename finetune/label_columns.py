"""Multi-label data laid out as a column per label, 1 where the text has the label and 0 where not
(``data.label_column: [toxic, insult, threat]``): the layout of Jigsaw's toxic comments, of many Hub data sets and of
most spreadsheets of tags. Each row's 1s become the set of its labels, the layout of a list column, so that what
follows reading is the same for both; the label ids keep the columns' order.

Written here: datasets reads each column as it is, and has no step that gathers several into one set.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from finetune.errors import DataError
from finetune.tables import RAW_LABEL, Table, as_arrow, as_mask

logger = logging.getLogger("finetune.data")

# how a column of 0/1 may be written: numbers, JSON's booleans, or the words of a spreadsheet's export
_WORDS = {"0": False, "1": True, "false": False, "true": True}


def gather_label_columns(table: Table, ds: datasets.Dataset, read_as: list[str], columns: list[str]
                         ) -> datasets.Dataset:
    """``ds`` with its columns ``read_as`` (the label columns ``columns``, renamed) replaced by one column of each
    row's labels: the ids of the columns that hold 1. A row with no value in one of them has ``None`` there, which
    ``data.on_missing_label`` drops or the encoder refuses.

    Raises:
        DataError: naming the column and row of a value that is not 0 or 1.
    """
    on = np.zeros((len(ds), len(columns)), dtype=bool)
    missing = np.zeros(len(ds), dtype=bool)
    arrow = as_arrow(ds)
    for j, (name, column) in enumerate(zip(read_as, columns)):
        cells = arrow.column(name)
        on[:, j], empty, wrong = _flags(cells)
        if wrong is not None:
            raise DataError(f"{table.source}: {cells[wrong].as_py()!r} at {table.where(wrong)} in column {column!r} is "
                            f"not 0 or 1 (data.label_column names a column per label: 1 where the text has it, else 0)")
        missing |= empty
    # as Arrow lists, built at once: the list of each row's ids, or null where the row has an empty cell
    offsets = np.concatenate([[0], np.cumsum(on.sum(axis=1))]).astype(np.int32)
    ids = pa.array(np.nonzero(on)[1].astype(np.int64))
    sets = pa.ListArray.from_arrays(pa.array(offsets), ids, mask=pa.array(missing))
    feature = datasets.List(datasets.ClassLabel(names=columns))
    return ds.remove_columns(read_as).add_column(RAW_LABEL, sets, feature=feature)


def _flags(cells: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, Optional[int]]:
    """A 0/1 column's cells: where each is 1, where each is empty, and the first that is neither 0 nor 1 (or None).
    Numbers and booleans at once, as most files hold them; words (``"1"``, ``"true"``) one by one."""
    if _numbers(cells):
        empty = as_mask(pc.is_null(cells, nan_is_null=True))
        numbers = pc.fill_null(pc.cast(cells, pa.float64()), 0.0).to_numpy(zero_copy_only=False)
        values = np.where(empty, 0.0, numbers)
        wrong = np.flatnonzero(~np.isin(values, (0.0, 1.0)))
        return values == 1.0, empty, int(wrong[0]) if len(wrong) else None
    read = [_word(value) for value in cells.to_pylist()]
    wrong_at = next((i for i, flag in enumerate(read) if flag is _NOT_A_FLAG), None)
    on = np.array([flag is True for flag in read], dtype=bool)
    return on, np.array([flag is None for flag in read], dtype=bool), wrong_at


_NOT_A_FLAG = object()


def _word(value: Any) -> Any:
    """A cell of a 0/1 column that is not a number: True or False, None where it is empty, else ``_NOT_A_FLAG``."""
    if value is None:
        return None
    if isinstance(value, str):
        return _WORDS.get(value.strip().casefold(), None if not value.strip() else _NOT_A_FLAG)
    return _NOT_A_FLAG


def warn_of_columns_without_ones(source: str, columns: list[str], names: list[str], dropped: Optional[list]) -> None:
    """Say which label columns the model has no output for: those without a 1 in the training data, which no
    text teaches (a list column's label that no row names is not one either, but nobody named it)."""
    absent = [column for column in columns if column not in names and column not in (dropped or [])]
    if absent:
        logger.warning("%s: %s no 1 in the training rows: the model has no output for %s (data.label_column)",
                       source, f"column {absent[0]!r} holds" if len(absent) == 1 else
                       f"columns {', '.join(map(repr, absent))} hold", "it" if len(absent) == 1 else "them")


def listed_hint(label_column: str, columns: list[str]) -> Optional[str]:
    """For a label column named as several, comma-separated (``--label toxic,insult``), that are the file's columns:
    the list that names them."""
    parts = [part.strip() for part in label_column.split(",")]
    if len(parts) < 2 or not all(part in columns for part in parts):
        return None
    return _as_list(parts) + " with model.problem_type=multi_label"


def _as_list(columns: list[str]) -> str:
    listed = ", ".join(columns)
    return f'a 0/1 column per label: --label "[{listed}]" (data.label_column=[{listed}])'


def per_label_hint(table: Table) -> Optional[str]:
    """For one 0/1 column read as multi-label lists, where the file has several: the list that names them all."""
    if table.as_read is None:
        return None
    sample = as_arrow(table.as_read.select(range(min(len(table.as_read), 1000))))
    texts = (table.text_column, table.pair_column)
    columns = [name for name in sample.column_names if name not in texts and _holds_flags(sample.column(name))]
    if len(columns) < 2:
        return None
    return _as_list(columns)


def _holds_flags(cells: pa.ChunkedArray) -> bool:
    """Whether a column of numbers or booleans holds 0 and 1 alone (empty cells aside)."""
    if not _numbers(cells):
        return False
    _, empty, wrong = _flags(cells)
    return wrong is None and not empty.all()


def _numbers(cells: pa.ChunkedArray) -> bool:
    return pa.types.is_integer(cells.type) or pa.types.is_floating(cells.type) or pa.types.is_boolean(cells.type)
