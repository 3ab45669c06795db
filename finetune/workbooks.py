"""An Excel workbook (``.xlsx``) read as a table: its first sheet, or the one ``data.sheet`` names, its first row
the header; and ``finetune predict``'s predictions written as one.

pandas reads it, with openpyxl. A cell holds a typed value rather than text:
a column whose cells are all numbers, all strings or all booleans keeps that
type, as a CSV column does; one that mixes them (a text column one of whose
texts Excel took for a number) is read as text, each number as it is shown.
Rows are named as Excel numbers them (``row 5``, the header being row 1), and
a row of empty cells is skipped, as a CSV file's blank line is.
"""

from __future__ import annotations

import datetime
import logging
import math
import re
from pathlib import Path
from typing import Any, Optional

import datasets
import numpy as np

from finetune.errors import DataError, FinetuneError, root_message
from finetune.tables import Table, repeated_names

logger = logging.getLogger("finetune.data")


def read_workbook(path: Path, sheet: Optional[str], flag: str = "data.sheet") -> Table:
    """The rows of ``sheet`` (None: the first) of the workbook ``path``, with its header row's columns; ``flag``:
    the setting or option that names another sheet, as messages name it.

    Raises:
        DataError: naming the file, for a workbook that cannot be read, a sheet it lacks, or a sheet without rows.
    """
    import pandas as pd

    try:
        with pd.ExcelFile(path, engine="openpyxl") as book:
            names = list(book.sheet_names)
            if sheet is not None and sheet not in names:
                raise DataError(f"{path}: no sheet {sheet!r} ({flag}); its sheets: {', '.join(names)}")
            chosen = names[0] if sheet is None else sheet
            frame = pd.read_excel(book, sheet_name=chosen, dtype=object)
            # pandas renames a name the header row repeats (text, text.1): the names as written, to refuse it by
            header = [] if frame.columns.empty else \
                list(pd.read_excel(book, sheet_name=chosen, header=None, nrows=1).iloc[0])
    except FinetuneError:
        raise
    except Exception as exc:  # noqa: BLE001 - not a workbook, or a damaged one: zipfile's and openpyxl's own words
        raise DataError(f"{path}: cannot read as an Excel workbook: {root_message(exc)}") from None
    if sheet is None and len(names) > 1:
        logger.info("%s: read its first sheet, %r, of %d (%s); %s names another", path, chosen, len(names),
                    ", ".join(names), flag)
    frame.columns = [str(name) for name in frame.columns]
    cells = {name: _one_type([_cell(value) for value in frame[name]]) for name in frame.columns}
    ds = datasets.Dataset.from_dict(cells)
    rows = np.flatnonzero([any(values[i] is not None for values in cells.values()) for i in range(len(ds))])
    if len(rows) == 0:
        raise DataError(f"{path}: sheet {chosen!r} has no rows below its header")
    return Table.whole(ds, str(path), unit="row", offset=2, empty_field_is_null=True,
                       repeated_columns=repeated_names(header)).keep(rows)


def _cell(value: Any) -> Any:
    """A cell's value as Python has it, ``None`` for an empty cell (which pandas gives as NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if isinstance(value, np.generic) else value


def _one_type(values: list[Any]) -> list[Any]:
    """A column's values as one type: as they are where they share one (numbers: ints and floats), else each as
    text, a number as Excel shows it (``3``, not ``3.0``)."""
    kinds = {_kind(value) for value in values if value is not None}
    if len(kinds) <= 1:
        return values
    return [None if value is None else _as_shown(value) for value in values]


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "text" if isinstance(value, str) else type(value).__name__


def _as_shown(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return str(value)


def write_workbook(path: Path, table: dict[str, list[Any]]) -> None:
    """``table`` (a column a name) as the one sheet, ``predictions``, of a workbook at ``path``.

    A text is written as text, though it starts with ``=`` (which a spreadsheet would take for a formula); the
    control characters a workbook cannot hold (all but tab and line ends) are written as U+FFFD; a value of
    another type than a workbook's (a time with its zone) as its text.
    """
    import openpyxl
    from openpyxl.cell import WriteOnlyCell

    book = openpyxl.Workbook(write_only=True)
    sheet = book.create_sheet("predictions")
    sheet.append(list(table))
    for values in zip(*table.values()):
        cells = []
        for value in values:
            cell = WriteOnlyCell(sheet, value=_writable(value))
            if isinstance(cell.value, str):
                cell.data_type = "s"  # a text, never a formula
            cells.append(cell)
        sheet.append(cells)
    book.save(path)


def _writable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (datetime.datetime, datetime.time)) and value.tzinfo is not None:
        return value.isoformat()
    if isinstance(value, (datetime.date, datetime.time)):
        return value
    return _CONTROL.sub("\ufffd", str(value))


# the characters a workbook's XML cannot hold: the C0 controls but tab, line feed and carriage return
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")
