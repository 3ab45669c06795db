"""Reading one local file or class folder into a :class:`~finetune.tables.Table`, with the file's own columns.

CSV, TSV (``.tsv``/``.tab``, or ``.txt`` of tab-separated lines; quotes read as ``data.quoting`` says:
:func:`finetune.csv_rows.quoting_of`), JSON or JSON Lines (each of these also compressed whole: ``reviews.csv.gz``,
``.bz2``, ``.xz``; a JSON object's one list of records, :mod:`finetune.nested_json`), Parquet, a folder with one
sub-folder per class holding ``.txt`` files (label = sub-folder name; :mod:`finetune.class_folders`), or a folder that
``datasets``' ``save_to_disk`` wrote (a ``DatasetDict``'s splits are read by :func:`read_saved_splits`). The format
comes from the extension (a ``.csv`` whose rows all split on tabs into as many fields reads as TSV, and one whose
records split on ``;`` more often than on ``,`` as a spreadsheet's semicolon-separated CSV, and one that starts with
Excel's ``sep=;`` line as that line says; a workbook, ``.xlsx``, is read by :mod:`finetune.workbooks`) unless
``data.format`` names it. The bytes are checked against ``data.encoding`` before any reader sees them, so that an
undecodable byte is named by its offset, and a first data row whose field count differs from the header stops the read
rather than shifting the columns.

:mod:`finetune.data` takes the table on from here (its columns, texts and
labels); :func:`read_table` is the same read for files without labels
(``finetune predict``).
"""

from __future__ import annotations

import codecs
import contextlib
import copy
import csv
import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import datasets
import numpy as np
import pyarrow.compute as pc

from finetune.class_folders import read_class_folders
from finetune.config import DataConfig
from finetune.csv_rows import (check_field_count, quoting_of, record_lines, refuse_unpaired_quote, repeated_header,
                               row_names_first, say_quoted_over_lines, say_repeated_header, unescaped,
                               without_row_names)
from finetune.errors import ConfigError, DataError, FinetuneError, root_message
from finetune.archives import as_given, in_an_archive
from finetune.format_errors import headerless_layout_refused, unsupported_format
from finetune.nested_json import object_over_lines_hint, rows_under_one_key
from finetune.remote_files import is_url
from finetune.resources import EXTENSIONS, SAVED_DATASET_DICT_FILE, WORKBOOKS, data_path, saved_by_datasets
from finetune.tables import Table, as_arrow, as_mask, repeated_names
from finetune.workbooks import read_workbook
from finetune.text_encoding import (compression_of, inner_suffix, is_utf8, marked_encoding, open_bytes, open_text,
                                    python_codec, undecodable)

logger = logging.getLogger("finetune.data")  # every note on reading the data has one logger, as tokens.py does too


def read_table(spec: str, key: str, cfg: Optional[DataConfig] = None,
               encoding_flag: str = "data.encoding", columns: tuple[str, ...] = ()) -> datasets.Dataset:
    """The rows of one local CSV, TSV, JSON(L) or Parquet file, with the file's own columns.

    The same readers, formats, header and quoting rules and encoding checks as
    training data (``cfg``'s, or the defaults: format from the extension, a
    header line), without any label checks: for files that carry no labels,
    such as those ``finetune.predict`` classifies. Of the file's columns, the
    ``columns`` the caller reads must not be named twice by its header.

    Raises:
        DataError: naming ``key`` and the file when it is missing, empty, unreadable or not in ``cfg``'s
            encoding (which ``encoding_flag`` sets, the error says), or when its header names one of
            ``columns`` twice.
    """
    table = read_local(spec, key, cfg or DataConfig(train_file=spec), encoding_flag)
    for column in columns:
        table.refuse_repeated(column, f"{key} {spec}", "the texts could be either")
    return table.ds


def read_local(spec: str, key: str, cfg: DataConfig, encoding_flag: str = "data.encoding") -> Table:
    """Read one local file (its own columns) or class folder into a :class:`Table`; a URL's file is read from
    its downloaded copy (:mod:`finetune.remote_files`), and named by its URL in the table and in any error."""
    path = data_path(spec, key)
    try:
        table = _read_path(path, key, cfg, encoding_flag)
    except DataError as exc:  # a copy's path is the cache's: the user gave the URL, or the archive
        raise type(exc)(_as_given(exc.message, path, spec), _as_given(exc.hint, path, spec)) from None
    return dataclasses.replace(table, source=_as_given(table.source, path, spec))


def _as_given(text: Optional[str], path: Path, spec: str) -> Optional[str]:
    """``text`` with the cache's paths named as the setting ``spec`` names them: the URL for its downloaded copy
    (``path``), the archive's path for its unpacked copy."""
    text = as_given(text)  # first: a file made from the downloaded copy is named as that copy
    if text and is_url(spec) and not in_an_archive(spec):
        text = text.replace(str(path), spec)
    return text


def _read_path(path: Path, key: str, cfg: DataConfig, encoding_flag: str) -> Table:
    cfg = _as_marked(path, cfg)
    fmt = _detect_format(path, cfg.format, key, cfg.encoding)
    if fmt not in ("csv", "tsv") and cfg.has_header is False:
        raise headerless_layout_refused(path, fmt, key, cfg)
    if cfg.sheet is not None and fmt != "excel" and key == "data.train_file":  # read on, it would be ignored
        raise ConfigError(f"data.sheet: names a sheet of an Excel workbook, and {key} {path} is not one ({fmt})")
    # likewise where no other file of the run could be one it applies to
    if cfg.quoting != "auto" and fmt not in ("csv", "tsv") and key == "data.train_file" and not (
            cfg.validation_file or cfg.test_file):
        raise ConfigError(f"data.quoting: says how a CSV or TSV file's quotes read, and {key} {path} is not one "
                          f"({fmt})")
    if fmt == "saved":
        return Table.whole(_load_from_disk(path), str(path), unit="row")
    if fmt == "saved splits":
        raise _several_splits(path, key)
    if fmt == "folder":
        return read_class_folders(path, cfg, data_extensions=tuple(EXTENSIONS))
    if not path.is_file():
        raise DataError(f"{key}: {path} is not a file (data.format: {fmt})")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file (no rows)")
    if fmt in ("csv", "tsv", "json") and cfg.encoding_errors == "strict":
        _check_decodes(path, cfg.encoding, encoding_flag)
    if fmt in ("csv", "tsv"):
        return _load_delimited(path, fmt, cfg, _named_as(encoding_flag, "quoting"))
    if fmt == "json":
        return _load_json(path, cfg)
    if fmt == "excel":
        return read_workbook(path, cfg.sheet, _named_as(encoding_flag, "sheet"))
    return Table.whole(_run_builder("parquet", path), str(path), unit="row")


def _named_as(encoding_flag: str, setting: str) -> str:
    """The name of the data ``setting`` where the encoding is named ``encoding_flag``: ``--sheet`` on a command line
    that has ``--encoding`` (``finetune predict``), ``data.sheet`` in a config."""
    return f"--{setting}" if encoding_flag.startswith("--") else f"data.{setting}"


def _as_marked(path: Path, cfg: DataConfig) -> DataConfig:
    """``cfg``, reading the file ``path`` in the UTF-16 or UTF-32 its byte-order mark declares where ``cfg`` names
    UTF-8, the default; said in one line."""
    suffix = inner_suffix(path)
    text = path.is_file() and (suffix == ".txt" or EXTENSIONS.get(suffix) in ("csv", "tsv", "json"))
    encoding = marked_encoding(path, cfg.encoding) if text else cfg.encoding
    if encoding == cfg.encoding:
        return cfg
    logger.info("%s: read as %s, as the byte-order mark it starts with says", path, encoding.upper())
    marked = copy.copy(cfg)
    marked.encoding = encoding
    return marked


def read_saved_splits(spec: str, key: str, fmt: str = "auto") -> Optional[datasets.DatasetDict]:
    """The splits of a ``DatasetDict`` that ``datasets``' ``save_to_disk`` wrote into the folder ``spec`` names,
    or ``None`` where ``spec`` names anything else (a file, a class folder, a saved ``Dataset``, or a URL's
    file: told apart without a request to its server, which the read makes)."""
    if fmt != "auto" or is_url(spec):
        return None
    path = data_path(spec, key)
    return _load_from_disk(path) if saved_by_datasets(path) == "dict" else None


def _load_from_disk(path: Path) -> datasets.Dataset | datasets.DatasetDict:
    try:
        with _failures_not_logged():
            loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - a damaged or partly copied folder fails in pyarrow's or json's words
        raise DataError(f"{path}: cannot read what datasets saved there: {root_message(exc)}") from None
    if isinstance(loaded, datasets.Dataset) and len(loaded) == 0:
        raise DataError(f"{path}: no rows")
    return loaded


def _several_splits(path: Path, key: str) -> DataError:
    """For a saved ``DatasetDict`` where one set of rows is read (a validation or prediction file)."""
    try:
        splits = json.loads((path / SAVED_DATASET_DICT_FILE).read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        splits = sorted(p.name for p in path.iterdir() if saved_by_datasets(p) == "dataset")
    likely = next((name for name in ("validation", "test", "dev", "valid") if name in splits), None)
    chosen = likely or (splits[0] if splits else "<split>")
    return DataError(f"{key}: {path} holds several splits that datasets saved ({', '.join(splits)}): name one",
                     hint=f"each is a folder of its own: {path / chosen}")


def _detect_format(path: Path, fmt: str, key: str, encoding: str) -> str:
    if path.is_dir():
        saved = saved_by_datasets(path) if fmt == "auto" else None
        if saved is not None:
            return "saved" if saved == "dataset" else "saved splits"
        if fmt not in ("auto", "folder"):
            raise DataError(f"{key}: {path} is a folder but data.format is {fmt}")
        return "folder"
    if fmt == "folder":
        raise DataError(f"{key}: {path} is not a folder (data.format: folder)")
    if fmt != "auto":
        return fmt
    suffix = inner_suffix(path)
    if path.suffix.lower() in WORKBOOKS:
        return WORKBOOKS[path.suffix.lower()]
    if suffix == ".txt" and tab_separated(path, encoding):
        logger.info("%s: its rows split on tabs into as many fields each: read as TSV", path)
        return "tsv"
    if suffix not in EXTENSIONS or (suffix == ".parquet" and compression_of(path)):
        raise unsupported_format(path, suffix, key)
    if EXTENSIONS[suffix] == "csv" and tab_separated(path, encoding):
        logger.info("%s: its rows split on tabs into as many fields each: read as TSV (data.format: csv to refuse)",
                    path)
        return "tsv"
    return EXTENSIONS[suffix]


def tab_separated(path: Path, encoding: str, lines: int = 20) -> bool:
    """Whether the first lines of a ``.csv`` file all hold the same, non-zero number of tabs, or its first records
    (a quoted text over several lines one record, as pandas' ``to_csv(sep="\\t")`` writes it) all split on tabs
    into the same number of fields, two or more."""
    counts = set()
    try:
        with open_text(path, encoding, errors="replace") as fh:
            for line in fh:
                if line.strip():
                    counts.add(line.count("\t"))
                    lines -= 1
                if lines == 0:
                    break
    except UnicodeError:  # no text in that encoding at all (UTF-16 without its mark): the check after says where
        return False
    return len(counts) == 1 and counts != {0} or _records_agreeing(path, encoding, "\t", every=True) > 0


def separator_line(path: Path, encoding: str) -> Optional[str]:
    """The separator a first line such as ``sep=;`` names: Excel reads the line to choose the separator, and some
    exports for Excel write it (pandas would take it for the header)."""
    with open_text(path, encoding, errors="replace") as fh:
        first = fh.readline(16).rstrip("\r\n").lstrip("\ufeff")
    return first[4] if len(first) == 5 and first.startswith("sep=") else None


def csv_separator(path: Path, encoding: str) -> str:
    """``;`` for a CSV file whose first records agree more often on ``;`` than on ``,``: else ``,``.

    Spreadsheets set to a language whose decimal mark is a comma (most of
    Europe's) save CSV with semicolons. A record agrees on a separator when it
    splits on it into as many fields as the first record (the header), two
    or more; a row with a field too many still leaves the others agreeing.
    A tie keeps the comma, so a file pandas reads today reads the same.
    """
    if _records_agreeing(path, encoding, ";") <= _records_agreeing(path, encoding, ","):
        return ","
    logger.info("%s: its lines split on ';', not on ',': read as semicolon-separated", path)
    return ";"


def _records_agreeing(path: Path, encoding: str, sep: str, records: int = 20, every: bool = False) -> int:
    """How many of a CSV file's first ``records`` records (quoted fields as CSV quotes them) split on ``sep``
    into as many fields as the first one does; 0 where the first does not split, or with ``every`` where one
    of them splits otherwise."""
    counts = []
    try:
        with open_text(path, encoding, errors="replace") as fh:
            for row in csv.reader(fh, delimiter=sep):
                if row:
                    counts.append(len(row))
                if len(counts) == records:
                    break
    except (UnicodeError, csv.Error):  # not text in that encoding, or a quote csv cannot parse: the read says
        return 0
    if not counts or counts[0] < 2 or every and len(set(counts)) > 1:
        return 0
    return counts.count(counts[0])


def _load_delimited(path: Path, fmt: str, cfg: DataConfig, quoting_flag: str) -> Table:
    if not cfg.has_header and not cfg.column_names:
        raise ConfigError(f"data.column_names: required with data.has_header: false ({path})")
    named = separator_line(path, cfg.encoding)
    skip = 1 if named else 0
    sep = named or ("\t" if fmt == "tsv" else csv_separator(path, cfg.encoding))
    path = unescaped(path, sep, cfg.encoding, skip, cfg.quoting)  # a copy where a quote in a quoted text is \"
    quoting = quoting_of(path, fmt, cfg.quoting, cfg.encoding, skip)  # a TSV's: CSV's where it is written so
    if cfg.has_header:  # names of its own where R's row names make a first column the header does not name
        header, names = 0, row_names_first(path, sep, quoting, cfg.encoding, skip)
    else:
        header, names = None, list(cfg.column_names)
    rows_from = skip + (header == 0 and names is not None)  # past a header its own names replace
    columns = check_field_count(path, sep, quoting, names, cfg.encoding, 1, rows_from, quoting_flag)
    try:
        ds = _read_delimited(path, sep, quoting, header, names, cfg, skip)
    except DataError as exc:
        if cfg.encoding_errors != "strict" and "UnicodeDecodeError" in exc.message:
            # datasets before 5.1 leave the setting out of pandas' read_csv under pandas 3 (a check of pandas'
            # version that reads its minor number alone), so the file was decoded strictly
            raise DataError(exc.message, hint=f"datasets {datasets.__version__} did not apply data.encoding_errors: "
                                              f"{cfg.encoding_errors} (before 5.1 it drops it beside pandas 3): "
                                              "upgrade datasets, or mend the bytes it names") from None
        # pandas names a quote that nothing closes, or a later row with too many fields, in words of its own
        # ("EOF inside string", "C error: Expected 2 fields in line 4, saw 3"); the checks over every row name
        # them as the first row's check does, at no cost to a file that reads
        if quoting != csv.QUOTE_NONE:
            refuse_unpaired_quote(path, sep, cfg.encoding, quoting_flag)
        check_field_count(path, sep, quoting, names, cfg.encoding, None, rows_from, quoting_flag)
        raise
    if rows_from > skip:
        ds = without_row_names(ds, path)
    starts = record_lines(path, sep, cfg.encoding, ds, skip + (header == 0), quoting_flag) \
        if quoting != csv.QUOTE_NONE else None
    if starts is not None and fmt == "tsv" and cfg.quoting == "auto":  # found CSV's: the other reading is said
        say_quoted_over_lines(path, ds, starts, quoting_flag)
    table = Table.whole(_header_unpadded(ds), str(path), unit="line", offset=(2 if cfg.has_header else 1) + skip,
                        empty_field_is_null=True, repeated_columns=repeated_names(columns or []))
    if starts is not None:  # a quoted field over line ends: each row is named by the line it starts on
        table = dataclasses.replace(table, positions=starts - table.offset)
    blank = functools.reduce(pc.and_, [pc.is_null(values) for values in as_arrow(ds).columns])
    repeated = repeated_header(ds) if header == 0 else np.zeros(len(ds), dtype=bool)
    say_repeated_header(table, repeated)
    rows = np.flatnonzero(~as_mask(blank) & ~repeated)
    if len(rows) == 0:
        raise DataError(f"{path}: empty file (no rows)")
    return table.keep(rows)


def _header_unpadded(ds: datasets.Dataset) -> datasets.Dataset:
    """The columns named without the spaces around them (``label `` is ``label``), as a spreadsheet may leave
    them: a name's padding cannot be seen, nor typed on a command line. Kept where two names would become one."""
    unpadded = {name: name.strip() for name in ds.column_names}
    if len(set(unpadded.values())) < len(unpadded) or "" in unpadded.values():
        return ds
    return ds.rename_columns({name: new for name, new in unpadded.items() if new != name})


def _read_delimited(path: Path, sep: str, quoting: int, header: Optional[int], names: Optional[list[str]],
                    cfg: DataConfig, skip: int) -> datasets.Dataset:
    return _run_builder(
        "csv",
        path,
        skiprows=skip,
        sep=sep,
        quoting=quoting,
        header=header,
        names=names,
        # Whatever the header says, never use a column as the index (pandas
        # does so silently when rows have one field more than the header).
        index_col=False,
        # Only empty fields are missing; "NA", "null", "None" are real texts.
        keep_default_na=False,
        na_values=[""],
        # Blank lines become all-null rows (skipped below) so row numbers stay line numbers.
        skip_blank_lines=False,
        encoding=python_codec(cfg.encoding),
        encoding_errors=cfg.encoding_errors,
    )


def _load_json(path: Path, cfg: DataConfig) -> Table:
    # The json builder reads UTF-8 itself, and re-decodes from any encoding named other than "utf-8", applying
    # `encoding_errors` there; "utf-8-sig" reads the same bytes as UTF-8 and gets there.
    plain = is_utf8(cfg.encoding) and cfg.encoding_errors == "strict"
    options = {} if plain else {"encoding": python_codec(cfg.encoding), "encoding_errors": cfg.encoding_errors}
    with open_bytes(path) as fh:
        start = fh.read(4096).lstrip(codecs.BOM_UTF8 + b" \t\r\n")
    try:
        ds = _run_builder("json", path, **options)
    except DataError as exc:
        hint = object_over_lines_hint(path) if exc.hint is None else None
        raise DataError(exc.message, hint) if hint else exc from None
    if start.startswith(b"["):
        return Table.whole(ds, str(path), unit="record")
    nested = rows_under_one_key(ds, str(path), cfg.text_column)
    if nested is not None:
        key, rows = nested
        return Table.whole(rows, str(path), unit=f"{key!r} record")
    return Table.whole(ds, str(path), unit="line")


def _run_builder(builder: str, path: Path, **options: Any) -> datasets.Dataset:
    """``datasets.load_dataset(builder)`` on one file, turning any failure into one DataError line."""
    try:
        with _failures_not_logged():
            ds = datasets.load_dataset(builder, data_files={"train": str(path)}, split="train", **options)
    except FinetuneError:
        raise
    except Exception as exc:  # noqa: BLE001 - pandas/pyarrow/datasets raise many types for bad input
        # A file with no rows (a CSV header alone, "[]") leaves the split empty,
        # which `datasets` reports as a missing split rather than returning 0 rows.
        if "corresponds to no data" in str(exc):
            raise DataError(f"{path}: empty file (no rows)") from None
        raise DataError(f"{path}: cannot read as {builder}: {root_message(exc)}") from None
    if len(ds) == 0:
        raise DataError(f"{path}: empty file (no rows)")
    return ds


@contextlib.contextmanager
def _failures_not_logged() -> Iterator[None]:
    """``datasets`` logs a failed read at ERROR before raising it; the raise becomes one line of the package's."""
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(verbosity)


def _check_decodes(path: Path, encoding: str, flag: str = "data.encoding") -> None:
    """Raise DataError with the byte offset of the first byte that ``encoding`` cannot decode."""
    decoder = codecs.getincrementaldecoder(encoding)()
    consumed = 0
    with open_bytes(path) as fh:
        while True:
            chunk = fh.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a character cut at the chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeError as exc:  # a UnicodeDecodeError, or UTF-16's missing byte-order mark (offset 0)
                # a compressed file's offset counts the bytes it holds, which is what `zcat | head -c` shows
                where = f"{path} (decompressed)" if compression_of(path) else str(path)
                raise undecodable(where, consumed - pending + getattr(exc, "start", 0), encoding, flag) from None
            if not chunk:
                return
            consumed += len(chunk)
