"""What a table read from a file or a data set becomes before its labels are encoded: the text, pair and label
columns under the standard names, texts as strings, and empty texts refused or dropped
(``data.on_empty_text``).

Its warnings are records of the ``finetune.data`` logger, as the rest of reading the data.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from finetune.column_hints import PANDAS_JSON_HINT, column_hint, pandas_layout, rename_hint
from finetune.errors import DataError, FileLayoutError
from finetune.label_columns import gather_label_columns, listed_hint
from finetune.schema import label_columns
from finetune.tables import GROUP, RAW_LABEL, TEXT, TEXT_PAIR, Table, as_arrow, as_mask, column_values, feature_name

logger = logging.getLogger("finetune.data")


def standardize(table: Table, text_column: str, pair_column: Optional[str], label_column: str | list[str],
                group: Optional[str] = None, beside: Optional[str] = None) -> Table:
    """Keep only the text, pair and label columns (and ``group``, the carve's), under the standard names; a column
    per label (``label_column`` a list) becomes one of each row's labels (:mod:`finetune.label_columns`).

    ``beside``: the training data that a validation or test file is read with, whose column names it must share.
    """
    ds = table.ds
    wanted = [("data.text_column", text_column, TEXT)]
    if pair_column is not None:
        wanted.append(("data.text_pair_column", pair_column, TEXT_PAIR))
    per_label = not isinstance(label_column, str)
    label_names = [f"{RAW_LABEL}{i}" for i in range(len(label_column))] if per_label else [RAW_LABEL]
    wanted += [("data.label_column", column, name) for column, name in zip(label_columns(label_column), label_names)]
    if group is not None:
        wanted.append(("data.validation_split_by", group, GROUP))
    for key, column, _ in wanted:
        table.refuse_repeated(column, table.source, f"{key} could mean either")
    missing = [(key, column) for key, column, _ in wanted if column not in ds.column_names]
    if missing:
        key, column = missing[0]
        # a column of the labels to guess, or to rename as the training data's, is one column
        keys = [k for k, _ in missing if not (per_label and k == "data.label_column")]
        configured = {k: c for k, c, _ in wanted if not (per_label and k == "data.label_column")}
        hint = None if not keys else column_hint(ds, keys, configured) if beside is None else (
            rename_hint(ds, keys, configured, beside))
        if key == "data.label_column" and not per_label:
            hint = listed_hint(label_column, ds.column_names) or hint
        raise FileLayoutError(
            f"{table.source}: no column {column!r} ({key}); columns found: {', '.join(ds.column_names)}", hint=hint)
    _warn_of_values_in_unnamed_fields(table, [column for _, column, _ in wanted])
    ds = ds.select_columns([column for _, column, _ in wanted])
    # Two steps, so that swapping names (text_column: label, label_column: text) works.
    ds = ds.rename_columns({column: f"_tmp{i}" for i, (_, column, _) in enumerate(wanted)})
    ds = ds.rename_columns({f"_tmp{i}": name for i, (_, _, name) in enumerate(wanted)})
    if per_label:
        ds = gather_label_columns(table, ds, label_names, label_columns(label_column))
    for name, column in ((TEXT, text_column), (TEXT_PAIR, pair_column)):
        if name not in ds.column_names:
            continue
        feature = ds.features[name]
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            continue
        mixed = _texts_of_mixed_types(ds, name)
        if mixed is not None:
            ds = ds.remove_columns(name).add_column(name, mixed, feature=datasets.Value("string"))
        elif isinstance(feature, datasets.Value):
            # Numbers (or an all-empty column) read from CSV: texts nonetheless.
            ds = ds.cast_column(name, datasets.Value("string"))
        else:
            raise DataError(f"{table.source}: column {column!r} holds {feature_name(feature)}, not texts",
                            hint=PANDAS_JSON_HINT if pandas_layout(table.ds) else None)
    return dataclasses.replace(
        table, ds=ds, text_column=text_column, pair_column=pair_column, label_column=label_column, as_read=table.ds
    )


def _warn_of_values_in_unnamed_fields(table: Table, read: list[str]) -> None:
    """Say where rows hold values in fields the header leaves unnamed (pandas calls them ``Unnamed: 2``, ...), which
    are not read: most often a text split across fields, its rest in the fields after it (a spreadsheet's export,
    Kaggle's SMS spam CSV)."""
    unnamed = [name for name in table.ds.column_names if name.startswith("Unnamed: ") and name not in read]
    if unnamed[:1] == [table.ds.column_names[0]] and _numbers_each_row(table.ds, unnamed[0]):
        logger.info("%s: its first column, unnamed, numbers the rows (the index pandas writes without index=False, "
                    "or the row names of R's write.csv): not read", table.source)
        unnamed = unnamed[1:]
    if not unnamed:
        return
    arrow = as_arrow(table.ds)
    filled = np.zeros(len(table.ds), dtype=bool)
    for name in unnamed:
        filled |= as_mask(pc.is_valid(arrow.column(name)))
    rows = np.flatnonzero(filled)
    if len(rows):
        logger.warning("%s: %d row%s hold%s values in fields the header leaves unnamed (%s), which are not read (%s): "
                       "is a text split across them?", table.source, len(rows),
                       "s" if len(rows) > 1 else "", "" if len(rows) > 1 else "s", ", ".join(unnamed),
                       table.where_many(rows))


def _numbers_each_row(ds: datasets.Dataset, name: str) -> bool:
    """Whether column ``name`` holds a whole number in every row, no two alike."""
    column = as_arrow(ds).column(name)
    return (pa.types.is_integer(column.type) and column.null_count == 0
            and len(pc.unique(column)) == len(column))


def drop_or_reject_empty_texts(table: Table, on_empty_text: str) -> Table:
    """Apply ``data.on_empty_text`` (``error`` or ``drop``) to null, empty and whitespace-only texts."""
    columns = [(TEXT, table.text_column)]
    if table.pair_column is not None:
        columns.append((TEXT_PAIR, table.pair_column))
    empty = np.zeros(len(table.ds), dtype=bool)
    culprits = []
    for name, source_column in columns:
        texts = table.ds.with_format("arrow")[name]
        mask = as_mask(pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(texts)), 0), True))
        if mask.any():
            culprits.append(repr(source_column))
        empty |= mask
    rows = np.flatnonzero(empty)
    if len(rows) == 0:
        return table
    what = f"{len(rows)} empty or null text{'s' if len(rows) > 1 else ''} in column {' and '.join(culprits)}"
    if table.files is not None:
        what = f"{len(rows)} empty text file{'s' if len(rows) > 1 else ''}"
    if on_empty_text == "error":
        raise DataError(f"{table.source}: {what} ({table.where_many(rows)}); set data.on_empty_text: drop to drop them")
    if len(rows) == len(table.ds):
        raise DataError(f"{table.source}: every text is empty ({what})")
    logger.warning("%s: dropped %s (%s)", table.source, what, table.where_many(rows))
    return table.keep(np.flatnonzero(~empty))


def _texts_of_mixed_types(ds: datasets.Dataset, column: str) -> Optional[list[Optional[str]]]:
    """A JSON text column that mixes strings and numbers (datasets' ``Json`` feature) as strings; else None."""
    json_feature = getattr(datasets, "Json", None)
    if json_feature is None or not isinstance(ds.features[column], json_feature):
        return None
    values = column_values(ds, column)
    if not all(value is None or isinstance(value, (str, int, float)) for value in values):
        return None  # lists or objects among them: not texts, said by the caller
    return [None if value is None else str(value) for value in values]
