"""Rows of a CSV or TSV file that its reader gets wrong without a word: lines a stray quote runs into one, a TSV
file's quotes, quotes escaped with backslashes, R's row names, and the header written again where files were
joined.

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

TSV has no one rule for quotes. Files that never quote (GLUE's) hold texts
that start with a ``"`` they never close, which CSV's rule would run into the
lines after them. pandas' ``to_csv(sep="\\t")``, the ``csv`` module and
spreadsheets quote a text that holds a tab, a line break or a quote as CSV
does (``"she said ""hi"" twice"``): read with quotes as plain characters, such a
text keeps its quotes doubled and breaks its row at its tabs and line
breaks. :func:`tsv_quoting` tells the two apart.

A quote inside a quoted text is written ``""`` by CSV's rule, ``\\"`` by R's
``write.table`` (``qmethod = "escape"``, its default) and MySQL's ``SELECT ...
INTO OUTFILE``. Read by CSV's rule, ``\\"`` ends the text, and pandas glues
what follows onto it (``she said \\hi\\" twice"``) or splits the row at a
separator inside it. :func:`unescaped` reads such a file from a copy with each
``\\"`` written ``""``; any other backslash stays as written (R escapes
nothing else).

R's ``write.table`` writes each row's name (its number, by default) as a first
field that the header does not name, so every row has a field more than the
header. Read by the header, each row would fail its field count; read as
pandas reads it, the numbers would be a column. :func:`row_names_first` finds
the layout, and the numbers are left out, said once.

Files joined whole (``cat a.csv b.csv > all.csv``) carry the second one's
header as a row, whose label is the label column's name: a class of its own.
A row that repeats every name of the header is no data, and is left out, said
with its lines.
"""

from __future__ import annotations

import csv
import functools
import logging
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Optional

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from finetune.archives import made_from
from finetune.errors import DataError, FileLayoutError
from finetune.tables import Table, as_arrow, as_mask
from finetune.text_encoding import compression_of, open_text, python_codec

logger = logging.getLogger("finetune.data")

ESCAPED_QUOTE = '\\"'
QUOTING = {"csv": csv.QUOTE_MINIMAL, "none": csv.QUOTE_NONE}  # data.quoting's settings other than auto
FIX = ('a field that starts with " lasts to the next lone " (a quote inside it is written ""): quote the whole text, '
       'or take the stray quote out; where the file never quotes, {} reads its quotes as plain characters')


def record_lines(path: Path, sep: str, encoding: str, ds: datasets.Dataset, before: int,
                 flag: str = "data.quoting") -> Optional[np.ndarray]:
    """The line each row of ``ds`` starts on, read from the CSV or TSV file ``path`` whose first ``before`` records
    are not rows (a ``sep=`` line, the header), where a field of ``ds`` spans lines; else None: each row is a line.

    Stops where a quote ran several lines into one row (:func:`refuse_unpaired_quote`), which a field over line
    ends is the sign of."""
    if not rows_over_lines(ds).any():
        return None
    starts = np.fromiter(_record_starts(path, sep, encoding, flag), dtype=np.int64)[before:]
    return starts if len(starts) == len(ds) else None  # records the reader parted otherwise: numbered as lines


def rows_over_lines(ds: datasets.Dataset) -> np.ndarray:
    """Whether each row of ``ds`` holds a line break in a text field."""
    over = np.zeros(len(ds), dtype=bool)
    for column in as_arrow(ds).columns:
        if _of_text(column):
            over |= as_mask(pc.match_substring_regex(column, "[\r\n]"))
    return over


def say_quoted_over_lines(path: Path, ds: datasets.Dataset, starts: np.ndarray, flag: str = "data.quoting") -> None:
    """Warn where the quotes of the TSV file ``path`` were found to read as CSV's (:func:`tsv_quoting`) and rows
    of ``ds`` (starting on the lines ``starts``) hold texts quoted over several lines: as pandas writes a text
    with line breaks, or a file that never quotes whose stray quote a later quote before a tab closes, the
    lines between read as one text; which it is, only ``flag`` (``data.quoting``) can say."""
    over = np.flatnonzero(rows_over_lines(ds))
    logger.warning("%s: %d %s quoted over several lines (the first on line %d), read by CSV's rule as pandas writes "
                   "a TSV file; where the file never quotes, %s reads its quotes as plain characters (%s: it is "
                   "written so)", path, len(over), "row's text is" if len(over) == 1 else "rows' texts are",
                   starts[over[0]], typed(flag, "none"), typed(flag, "csv"))


def typed(flag: str, value: str) -> str:
    """``flag`` set to ``value`` as it is typed: ``--quoting none`` on a command line, ``data.quoting=none`` as a
    config key."""
    return f"{flag} {value}" if flag.startswith("--") else f"{flag}={value}"


def refuse_unpaired_quote(path: Path, sep: str, encoding: str, flag: str = "data.quoting") -> None:
    """Raise DataError naming the first line whose quote runs over line ends and then breaks CSV's rule: more
    text after the quote that closes it, or no quote to close it before the file ends; its hint names ``flag``,
    the setting of the file's quotes."""
    for _ in _record_starts(path, sep, encoding, flag):
        pass


def _record_starts(path: Path, sep: str, encoding: str, flag: str) -> Iterator[int]:
    """The line each record of ``path`` starts on (a blank line is a record, as the reader's blank row), raising
    :func:`refuse_unpaired_quote`'s DataError at the first quote that runs lines together."""
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
                                    f"there to the end ({reader.line_num}) would read as one field",
                                    hint=FIX.format(typed(flag, "none"))) from None
                if reader.line_num > start:
                    raise DataError(f"{path}: line {start} opens a quote that closes on line {reader.line_num} "
                                    f"with more text after it: lines {start} to {reader.line_num} would read as "
                                    "one row", hint=FIX.format(typed(flag, "none"))) from None
                # a quote closed with more text after it on its own line: a row all the same
            yield start
            start = reader.line_num + 1


def check_field_count(path: Path, sep: str, quoting: int, names: Optional[list[str]], encoding: str,
                      rows: Optional[int], skip: int, flag: str = "data.quoting") -> Optional[list[str]]:
    """Reject a data row, among the first ``rows`` (None: all), whose field count differs from the header or
    ``column_names``; return the header's names (``column_names`` where given; None for an empty file). The
    first ``skip`` lines are not the table's (a separator line). A record of several lines whose count is off is
    told as the quote that ran them together, where one did (:func:`refuse_unpaired_quote`; ``flag``: the setting
    of the file's quotes).

    pandas would otherwise shift columns silently when the first data row is
    the odd one (turning its first field into the index) or drop the extra
    fields.
    """
    with open_text(path, encoding, errors="replace") as fh:
        for _ in range(skip):
            fh.readline()
        reader = csv.reader(fh, delimiter=sep, quoting=quoting)
        header = names
        if header is None:
            header = next(reader, None)
            if header is None:
                return None
        end = reader.line_num
        for row in reader:
            start, end = end + 1, reader.line_num  # the lines the record spans
            if not row:
                continue  # blank line
            if len(row) != len(header):
                if end > start and quoting != csv.QUOTE_NONE:
                    refuse_unpaired_quote(path, sep, encoding, flag)
                source = "data.column_names" if names is not None else "the header"
                raise FileLayoutError(
                    f"{path}: line {start + skip} has {len(row)} field{'' if len(row) == 1 else 's'} but {source} has "
                    f"{len(header)} ({', '.join(header)})",
                    hint=quote_hint(sep) if len(row) > len(header) else None,
                )
            if rows is not None:
                rows -= 1
                if rows == 0:
                    return header
    return header


def quote_hint(sep: str) -> str:
    """What a row with a field too many most often needs: its text quoted as CSV quotes one, or its tabs taken out."""
    if sep == "\t":
        return ('a field that holds a tab must be in double quotes, as pandas\' to_csv(sep="\\t") writes it, or '
                'lose its tabs')
    shown = {",": "a comma", ";": "a semicolon"}.get(sep, repr(sep))
    return f'a field that holds {shown} must be in double quotes ("like{sep} this")'


def unescaped(path: Path, sep: str, encoding: str, skip: int, setting: str = "auto") -> Path:
    """``path``, or where it breaks CSV's rule and holds ``\\"``, which read as CSV's ``""`` keeps it, a copy of it
    so written (:func:`finetune.archives.made_from`, once; errors name ``path``), said once. Under ``auto``
    (``data.quoting``: ``setting``) a TSV file's copy is taken where its quotes then read as CSV's
    (:func:`tsv_quoting`; its first ``skip`` lines not the table's), so that a file whose quotes are plain
    characters keeps its backslashes as written; under ``none`` no file's quotes are CSV's, nor its copy taken."""
    if setting == "none" or not _holds_escaped_quote(path, encoding) or _parses(
            path, sep, encoding, unescape=False) or not _parses(path, sep, encoding, unescape=True):
        return path
    name = path.stem if compression_of(path) else path.name  # written whole
    copy = made_from(path, "unescaped", name, functools.partial(_write_unescaped, path, encoding))
    if sep == "\t" and setting == "auto" and tsv_quoting(copy, encoding, skip) != csv.QUOTE_MINIMAL:
        return path
    logger.info('%s: a quote inside a quoted text is written \\" (as R\'s write.table writes it), not "" as in '
                "CSV: read as a quote", path)
    return copy


def _holds_escaped_quote(path: Path, encoding: str) -> bool:
    with open_text(path, encoding, errors="replace") as fh:
        tail = ""
        while chunk := fh.read(1 << 20):
            if ESCAPED_QUOTE in tail + chunk:
                return True
            tail = chunk[-1:]
    return False


def _parses(path: Path, sep: str, encoding: str, unescape: bool) -> bool:
    """Whether ``path`` reads under CSV's strict rules, each ``\\"`` taken as ``""`` where ``unescape``."""
    with open_text(path, encoding, errors="surrogateescape") as fh:
        lines = (line.replace(ESCAPED_QUOTE, '""') for line in fh) if unescape else fh
        return _field_counts(lines, sep, csv.QUOTE_MINIMAL) is not None


def _write_unescaped(path: Path, encoding: str, target: Path) -> None:
    """``path`` written to ``target`` whole, in its encoding, each ``\\"`` as ``""``; bytes its encoding cannot
    decode kept as they are, for the read to treat as it treats them in ``path``."""
    with open_text(path, encoding, errors="surrogateescape") as fh, \
            open(target, "w", encoding=python_codec(encoding), errors="surrogateescape", newline="") as out:
        for line in fh:
            out.write(line.replace(ESCAPED_QUOTE, '""'))


def quoting_of(path: Path, fmt: str, setting: str, encoding: str, skip: int = 0) -> int:
    """How the quotes of the CSV or TSV (``fmt``) file ``path`` read, as ``data.quoting`` (``setting``) says: as
    CSV's (``csv.QUOTE_MINIMAL``), as plain characters (``csv.QUOTE_NONE``), or under ``auto`` CSV's in a CSV
    file and as :func:`tsv_quoting` finds in a TSV file (its first ``skip`` lines not the table's)."""
    if setting != "auto":
        return QUOTING[setting]
    return tsv_quoting(path, encoding, skip) if fmt == "tsv" else csv.QUOTE_MINIMAL


def tsv_quoting(path: Path, encoding: str, skip: int = 0) -> int:
    """How the quotes of the TSV file ``path`` read (its first ``skip`` lines not the table's): as CSV's
    (``csv.QUOTE_MINIMAL``) where a field starts with one, the whole file parses under CSV's strict rules, and no
    more of its records split into another number of fields than most do so than with plain quotes; else as
    plain characters (``csv.QUOTE_NONE``). A file where no field starts with a quote reads the same either way,
    and is read once to find that out. Counting the odd records both ways keeps a quoted file with one row of a
    field too many quoted, so that its error names that row, not the first text over several lines."""
    if not _a_field_starts_quoted(path, encoding, skip):
        return csv.QUOTE_NONE
    quoted = _odd_records(path, encoding, skip, csv.QUOTE_MINIMAL)
    plain = _odd_records(path, encoding, skip, csv.QUOTE_NONE) if quoted is not None else None
    return csv.QUOTE_NONE if quoted is None or plain is not None and quoted > plain else csv.QUOTE_MINIMAL


def _odd_records(path: Path, encoding: str, skip: int, quoting: int) -> Optional[int]:
    """How many records of the TSV file ``path`` split into another number of fields than most of them do (the
    header is odd where R's row names lengthen every row), read with ``quoting``; None where the ``csv`` module
    cannot read them so (:func:`_field_counts`)."""
    with open_text(path, encoding, errors="replace") as fh:
        for _ in range(skip):
            fh.readline()
        counts = _field_counts(fh, "\t", quoting)
    return None if counts is None else counts.total() - max(counts.values(), default=0)


def _field_counts(lines: Iterable[str], sep: str, quoting: int) -> Optional[Counter]:
    """How many records of ``lines`` split into each number of fields (a blank line is no record), read with
    ``quoting`` under CSV's strict rules; None where the ``csv`` module cannot read them so (a quote closed with
    more text after it, or never; a field past its size limit)."""
    try:
        return Counter(len(row) for row in csv.reader(lines, delimiter=sep, quoting=quoting, strict=True) if row)
    except csv.Error:
        return None


def _a_field_starts_quoted(path: Path, encoding: str, skip: int) -> bool:
    """Whether a line of ``path`` past its first ``skip`` has a field that starts with ``"``."""
    with open_text(path, encoding, errors="replace") as fh:
        for number, line in enumerate(fh):
            if number >= skip and (line.startswith('"') or '\t"' in line):
                return True
    return False


def row_names_first(path: Path, sep: str, quoting: int, encoding: str, skip: int) -> Optional[list[str]]:
    """The columns of ``path`` (its first ``skip`` lines not the table's), row names first, where every record past
    the header has one field more than the header, that field a whole number no other record starts with: the
    row names R's ``write.table`` writes by default under a header that does not name them. Else None, where the
    first row is not so.

    Only such numbers make the layout: a first field of text may be a row's own text, with a stray separator
    at its end (``great film,pos,``). The file is read past its first record only where that record fits.

    Raises:
        FileLayoutError: naming the first row that breaks the layout the rows before it keep.
    """
    with open_text(path, encoding, errors="replace") as fh:
        for _ in range(skip):
            fh.readline()
        reader = csv.reader(fh, delimiter=sep, quoting=quoting)
        seen: set[str] = set()
        try:
            header = next((row for row in reader if row), [])
            end = reader.line_num
            for row in reader:
                start, end = end + 1, reader.line_num
                if not row:  # a blank line
                    continue
                if len(row) != len(header) + 1 or not (row[0].isascii() and row[0].isdigit()) or row[0] in seen:
                    if not seen:
                        return None
                    raise FileLayoutError(f"{path}: line {start + skip} has {len(row)} fields, the first {row[0]!r}, "
                                          f"where each row before it has {len(header) + 1}, the first a row number of "
                                          "its own (the row names R's write.table writes) and then the header's")
                seen.add(row[0])
        except csv.Error:  # a field past the module's size limit: the read names what it finds
            return None
    return [_unused_name("row.names", header), *header] if seen else None


def _unused_name(name: str, names: list[str]) -> str:
    while name in names:
        name = f"_{name}"
    return name


def without_row_names(ds: datasets.Dataset, path: Path) -> datasets.Dataset:
    """``ds`` without its first column, the row names :func:`row_names_first` found, said once."""
    logger.info("%s: left out the first field of each row, which the header does not name: the row numbers R's "
                "write.table writes (row.names = TRUE)", path)
    return ds.remove_columns(ds.column_names[0])


def repeated_header(ds: datasets.Dataset) -> np.ndarray:
    """Which rows of ``ds``, read with a header, write every one of its column names again, each in its own
    column; a column not of strings holds no name."""
    table = as_arrow(ds)
    if not all(_of_text(column) for column in table.columns):
        return np.zeros(len(ds), dtype=bool)
    same = functools.reduce(pc.and_, [pc.equal(column, name) for column, name in zip(table.columns, ds.column_names)])
    return as_mask(pc.fill_null(same, False))


def _of_text(column: pa.ChunkedArray) -> bool:
    return pa.types.is_string(column.type) or pa.types.is_large_string(column.type)


def say_repeated_header(table: Table, repeated: np.ndarray) -> None:
    """Say which lines were left out for repeating the header."""
    if repeated.any():
        logger.warning("%s: left out %s, which repeat%s the header (files joined with their headers?)", table.source,
                       table.where_many(np.flatnonzero(repeated)), "s" if repeated.sum() == 1 else "")
