"""A quote in a CSV file that runs its rows together.

In a CSV file a field that starts with ``"`` lasts to the next lone ``"``,
over line ends. A text typed with a quote at its start and none at its end
(``"great film, loved it`` in a hand-made file) opens such a field, and the
lines after it up to the next quote in the file become part of one text:
pandas, which ``datasets`` reads CSV with, takes the text after that quote too
and reads on, so rows vanish without a word. Where the next quote is followed
by more text, or none comes, the file breaks CSV's rule, which the standard
library's ``csv`` module checks in its strict mode; that is the case caught
here. A quote that happens to close right before a comma leaves a valid file
that means the same as a text spanning lines, and cannot be told from one.

The check reads the file again, and so runs only where the read made a field
that spans lines, the sign of a quoted field over line ends.
"""

from __future__ import annotations

import csv
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from finetune.errors import DataError
from finetune.tables import as_arrow
from finetune.text_encoding import open_text

FIX = ('a field that starts with " lasts to the next lone " (a quote inside it is written ""): quote the whole text, '
       'or take the stray quote out')


def refuse_rows_run_together(path: Path, sep: str, encoding: str, ds: datasets.Dataset) -> None:
    """Stop where a quote of the CSV file ``path`` (read into ``ds``) ran several of its lines into one row."""
    if spans_lines(ds):
        refuse_unpaired_quote(path, sep, encoding)


def spans_lines(ds: datasets.Dataset) -> bool:
    """Whether a text field of ``ds`` holds a line break."""
    table = as_arrow(ds)
    return any((pa.types.is_string(column.type) or pa.types.is_large_string(column.type))
               and pc.any(pc.match_substring_regex(column, "[\r\n]")).as_py() for column in table.columns)


def refuse_unpaired_quote(path: Path, sep: str, encoding: str) -> None:
    """Raise DataError naming the first line whose quote runs over line ends and then breaks CSV's rule: more
    text after the quote that closes it, or no quote to close it before the file ends."""
    with open_text(path, encoding, errors="replace") as fh:
        reader = csv.reader(fh, delimiter=sep, strict=True)
        start = 1
        while True:
            try:
                if next(reader, None) is None:
                    return
            except csv.Error as exc:
                if "end of data" in str(exc):
                    raise DataError(f"{path}: line {start} opens a quote that nothing closes: every line from "
                                    f"there to the end ({reader.line_num}) would read as one field", hint=FIX) from None
                if reader.line_num > start:
                    raise DataError(f"{path}: line {start} opens a quote that closes on line {reader.line_num} "
                                    f"with more text after it: lines {start} to {reader.line_num} would read as "
                                    "one row", hint=FIX) from None
            start = reader.line_num + 1
