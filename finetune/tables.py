"""A split being read: its rows, where each one sits in its source, and the column helpers its readers share.

:mod:`finetune.local_files` and :mod:`finetune.data` read files and Hub data sets into a :class:`Table` each,
and :mod:`finetune.labels` turns its label column into ids; both name rows in
their errors as a user counts them in the file, through :meth:`Table.where`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

import datasets
import numpy as np
import pyarrow as pa

from finetune.columns import read_column
from finetune.errors import FileLayoutError

# Column names inside the returned splits.
TEXT = "text"
TEXT_PAIR = "text_pair"
LABELS = "labels"
RAW_LABEL = "_raw_label"  # the label column before it becomes class ids
GROUP = "_group"  # the column data.validation_split_by names, until the carve has read it

SHOW_ROWS = 5  # rows quoted in an error message before "..."
SHOW_LABELS = 10


@dataclass
class Table:
    """A split being prepared, and where each of its rows sits in the source.

    Rows may be dropped along the way (blank lines, empty texts); ``positions``
    keeps each remaining row's 0-based record number in the source so messages
    can still point at the right line.
    """

    ds: datasets.Dataset
    source: str  # file path or Hub split, the prefix of every message
    positions: np.ndarray
    unit: str  # "line", "record", "row" or "file"
    offset: int = 1  # number of the first record in `unit`s (2 after a CSV header)
    files: Optional[list[str]] = None  # folder layout: record -> relative file path
    text_column: str = TEXT  # the user's column names, for messages
    pair_column: Optional[str] = None
    label_column: str | list[str] = "label"  # a list: a column per label (finetune.label_columns)
    # CSV/TSV: an empty field reads as null, so "no value" and "empty string" look the same
    empty_field_is_null: bool = False
    # CSV/TSV: names the header writes more than once, with their fields (1-based); the reader renames the later
    # ones (`label.1`), so a column named so could be either
    repeated_columns: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # the rows with the source's own columns, kept once the standard ones are chosen: for a hint naming another
    as_read: Optional[datasets.Dataset] = None

    @classmethod
    def whole(cls, ds: datasets.Dataset, source: str, unit: str, offset: int = 1, **extra: Any) -> Table:
        """A table of every row of ``ds``, as its reader found them."""
        return cls(ds=ds, source=source, positions=np.arange(len(ds)), unit=unit, offset=offset, **extra)

    def refuse_repeated(self, column: str, source: str, so: str) -> None:
        """Stop where the header names ``column`` more than once: the reader took the first without a word.
        ``so`` ends the line, saying what could not be told apart (``data.label_column could mean either``)."""
        if column in self.repeated_columns:
            fields = " and ".join(map(str, self.repeated_columns[column]))
            raise FileLayoutError(f"{source}: the header names {column!r} in fields {fields}, so {so}",
                                  hint="rename one of them in the header")

    def where(self, i: int) -> str:
        """Where row ``i`` of ``ds`` is, e.g. ``line 5``."""
        return f"{self.unit} {self._number(i)}"

    def where_many(self, rows: np.ndarray | list[int]) -> str:
        """Where the first few of ``rows`` are, e.g. ``lines 5, 9, ...``."""
        numbers = [self._number(i) for i in rows[:SHOW_ROWS]]
        more = ", ..." if len(rows) > SHOW_ROWS else ""
        unit = self.unit if len(rows) == 1 else self.unit + "s"
        return f"{unit} {', '.join(numbers)}{more}"

    def _number(self, i: int) -> str:
        position = int(self.positions[i])
        if self.files is not None:
            return self.files[position]
        return str(position + self.offset)

    def keep(self, rows: np.ndarray) -> Table:
        """This table with only ``rows`` (indices into ``ds``) left."""
        if len(rows) == len(self.ds):
            return self
        return dataclasses.replace(self, ds=self.ds.select(rows), positions=self.positions[rows])


def repeated_names(header: list[Any]) -> dict[str, list[int]]:
    """The names a header writes more than once (the spaces around a name are not part of it; an empty cell of a
    workbook's header row names nothing), with their 1-based fields: what :meth:`Table.refuse_repeated` refuses."""
    fields: dict[str, list[int]] = {}
    for i, name in enumerate(header, start=1):
        if name is not None and not (isinstance(name, float) and name != name):  # NaN: pandas' empty cell
            fields.setdefault(str(name).strip(), []).append(i)
    return {name: where for name, where in fields.items() if len(where) > 1}


def column_values(ds: datasets.Dataset, name: str) -> list[Any]:
    """A column's values as Python objects, honouring any selection of rows.

    A JSON column whose rows hold values of several types (``0`` and
    ``"ham"``) gets datasets' ``Json`` feature, stored as each value's JSON
    text (``'"ham"'``): such values are decoded here.
    """
    values = read_column(ds, name)
    json_feature = getattr(datasets, "Json", None)  # datasets' releases before the Json feature have no such columns
    if json_feature is not None and isinstance(ds.features[name], json_feature):
        values = [None if value is None else json.loads(value) for value in values]
    return values


def as_arrow(ds: datasets.Dataset) -> pa.Table:
    """The dataset's rows as an Arrow table, honouring any selection of rows."""
    return ds.with_format("arrow")[:]


def as_mask(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A boolean Arrow array as a NumPy one."""
    return np.asarray(array.to_numpy(zero_copy_only=False), dtype=bool)


def lists_or_mappings(feature: Any) -> bool:
    """Whether a column of ``feature`` holds lists or mappings: never texts (numbers, and datasets' JSON type of
    values of several types, read as texts), and never a value of pandas' layouts."""
    return isinstance(feature, (dict, datasets.List, datasets.LargeList))


def feature_name(feature: Any) -> str:
    if isinstance(feature, datasets.ClassLabel):
        return "class labels"
    return f"{type(feature).__name__} values"


def short_list(names: list[str], limit: int) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
