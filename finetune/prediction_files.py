"""The files ``finetune predict`` reads: texts in, one prediction per input row out.

``--file`` takes ``.txt`` (one text per line, unless its lines are a table's: :func:`file_kind`; ``-`` reads such
lines from standard input), ``.csv``/``.tsv`` with a header (or laid out as the run's headerless files:
:func:`runs_layout`), ``.json``/``.jsonl`` (each of these also compressed whole: ``texts.csv.gz``, ``.bz2``,
``.xz``), ``.parquet``, ``.xlsx`` or a folder ``datasets``' ``save_to_disk`` wrote
(:mod:`finetune.prediction_output` writes the predictions). Every input row gets one output row, in order, its
columns kept and the prediction added (under ``predicted_<name>`` where the input has a column of the prediction's
names, a labelled file's ``label``); an empty text gets an empty prediction, so the rows line up. The command's
options are checked here too, before any file or model is read (:func:`check_options`).
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from finetune.errors import ConfigError, DataError, ModelError, is_main_rank
from finetune.resources import EXTENSIONS, WORKBOOKS, data_path, saved_by_datasets
from finetune.schema import checked_threshold, label_columns  # the schema alone: no YAML or config loaded
from finetune.text_encoding import COMPRESSIONS, check_encoding, compression_of, inner_suffix, open_bytes, open_text

# the formats training reads, and plain lines of text
INPUT_FORMATS = (".txt", *EXTENSIONS, *WORKBOOKS)
# read as they are, never compressed again: Parquet compresses its columns, a workbook is a zip archive
WHOLE_FORMATS = (".parquet", *WORKBOOKS)
STDIN = "-"  # --file -: one text per line from standard input, as a .txt file
SAVED = "saved"  # what read_rows calls a folder that datasets' save_to_disk wrote, in place of an extension
TEXT_FOLDER = "folder"  # and a folder of .txt files (in sub-folders too: a class folder), each file a text
ONE_TEXT_EACH = (".txt", TEXT_FOLDER)  # kinds whose every line, or file, is a text: no columns to name
OUTPUT_FORMATS = (".csv", ".tsv", ".jsonl", ".parquet", ".xlsx")


def checked_suffix(path: Path, allowed: Sequence[str], what: str) -> str:
    """``path``'s lower-case extension, one of ``allowed``.

    Raises:
        DataError: naming ``what`` (``--output``) and the path.
    """
    suffix = path.suffix.lower()
    if suffix not in allowed:
        raise DataError(f"{what} {path}: unsupported extension {suffix or '(none)'!r} (use {', '.join(allowed)})")
    return suffix


def input_kind(file: str | os.PathLike) -> str:
    """What a ``--file`` is: :data:`SAVED`, :data:`TEXT_FOLDER`, or its lower-case extension, one of
    :data:`INPUT_FORMATS`, that of the file it holds where it is compressed whole (``.csv`` for ``texts.csv.gz``).

    Raises:
        DataError: naming the path where it is neither, or not there.
    """
    path = Path(file)
    if saved_by_datasets(path) is not None:
        return SAVED
    if path.is_dir():
        if any(_visible_text_files(path)):  # the first one found answers: no walk of the whole folder
            return TEXT_FOLDER
        raise DataError(f"--file {path}: a folder without .txt files, and not one that datasets' save_to_disk "
                        f"wrote (give a file: {', '.join(INPUT_FORMATS)})")
    suffix = inner_suffix(path)
    if suffix not in INPUT_FORMATS or (suffix in WHOLE_FORMATS and compression_of(path)):
        shown = suffix + (compression_of(path) or "") or "(none)"
        raise DataError(f"--file {path}: unsupported extension {shown!r} (use {', '.join(INPUT_FORMATS)}; all "
                        f"but {', '.join(WHOLE_FORMATS)} also compressed as {', '.join(COMPRESSIONS)})")
    if not path.is_file():
        raise DataError(f"--file {path}: not found")
    return suffix


def file_kind(file: str | os.PathLike, encoding: str, text_column: str, run_data=None) -> str:
    """:func:`input_kind`, but ``.tsv`` for a ``.txt`` file that holds a table, as training reads one: its lines
    split on tabs alike (:func:`finetune.local_files.tab_separated`), the first naming ``text_column`` or, where the
    run read headerless files (``run_data.column_names``), splitting into as many fields as the run's columns.
    Any other ``.txt`` file holds a text a line."""
    kind = input_kind(file)
    if kind != ".txt":
        return kind
    from finetune.local_files import tab_separated  # the readers of training data: datasets comes with them

    names = run_data.column_names if run_data is not None else None
    fields = [field.strip() for field in first_line_fields(file, encoding, "\t")]
    table = tab_separated(Path(file), encoding) and (text_column in fields or bool(names) and len(fields) == len(names))
    return ".tsv" if table else kind


def _text_files_in(folder: Path) -> list[Path]:
    """The ``.txt`` files under ``folder``, its sub-folders too, in the order of their paths; hidden ones (a
    notebook's ``.ipynb_checkpoints/``) left out, as training's class folders leave them."""
    return sorted(_visible_text_files(folder), key=lambda p: p.relative_to(folder).as_posix())


def _visible_text_files(folder: Path) -> Iterator[Path]:
    """The ``.txt`` files under ``folder`` as the walk finds them, hidden ones left out."""
    return (p for p in folder.rglob("*.txt") if not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _text_files(folder: Path, encoding: str) -> list[dict[str, Any]]:
    """Each ``.txt`` file under ``folder`` (:func:`_text_files_in`) as a row ``{"file": <path in the folder>,
    "text": <the whole file>}``."""
    from finetune.text_encoding import decoded

    return [{"file": path.relative_to(folder).as_posix(),
             "text": decoded(path.read_bytes(), str(path), encoding, flag="--encoding")}
            for path in _text_files_in(folder)]


def local_file(given: str) -> str:
    """The file ``--file`` names on this machine: a URL's downloaded copy, the file an archive holds
    (:func:`finetune.resources.data_path`), else ``given`` itself."""
    from finetune.archives import in_an_archive
    from finetune.remote_files import is_url

    return str(data_path(given, "--file")) if is_url(given) or in_an_archive(given) else given


def check_options(args: argparse.Namespace) -> None:
    """The options that can be checked alone, or against each other, before any file or model is read
    (``--precision`` aside, which ``finetune score`` shares: :func:`finetune.precisions.check_precision`).

    Raises:
        ConfigError, DataError or ModelError naming the option.
    """
    from finetune.launch import launched_world_size  # the launcher's variables alone: no torch imported

    for flag, column in (("--text", args.text_column), ("--text-pair", args.text_pair_column)):
        if column is not None and not args.file:  # `--text "a sentence"` would otherwise classify nothing
            raise ConfigError(f"{flag} {column!r}: names a column of a --file; texts to classify follow the "
                              f"run's folder: finetune predict {args.output_dir} \"a text\"")
    if not args.texts and not args.file:
        raise ConfigError("nothing to classify: give texts or --file")
    if args.texts and args.file:
        raise ConfigError("give texts or --file, not both")
    if args.output and not args.file:
        raise ConfigError("--output: only with --file")
    if args.split is not None and not args.file:
        raise ConfigError(f"--split {args.split}: names a split of a --file's rows; give the --file")
    if args.split_column is not None and args.split is None:
        raise ConfigError(f"--split-column {args.split_column}: names the column --split reads; give --split too")
    # every launched process inherits the one standard input, and each would read other lines
    if args.file == STDIN and launched_world_size() > 1:
        raise ConfigError("--file -: standard input cannot be shared by the processes launched; give a file")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.encoding is not None:
        if not args.file:
            raise ConfigError(f"--encoding {args.encoding}: only with --file")
        check_encoding(args.encoding, "--encoding")
    if args.threshold is not None:  # a number, or by label name as evaluation.threshold takes them
        from finetune.config import parse_override
        args.threshold = checked_threshold(parse_override(f"--threshold={args.threshold}")[1], "--threshold")
    if args.output:
        checked_suffix(Path(args.output), OUTPUT_FORMATS, "--output")
        if not Path(args.output).resolve().parent.is_dir():
            raise DataError(f"--output {args.output}: its directory does not exist")
    if not Path(args.output_dir).is_dir():
        raise ModelError(f"{args.output_dir}: not found (pass a run's output_dir)")


def read_rows(path: str | os.PathLike, text_column: str = "text", text_pair_column: Optional[str] = None,
              encoding: str = "utf-8", sheet: Optional[str] = None, split: Optional[str] = None,
              split_column: Optional[str] = None, run_data=None, kind: Optional[str] = None,
              quoting: Optional[str] = None) -> list[dict[str, Any]]:
    """The rows of a ``.txt``, ``.csv``, ``.tsv``, ``.json``, ``.jsonl`` or ``.parquet`` file, or of a folder
    ``datasets`` saved, every column kept; with ``split``, those of that split alone: the rows whose
    ``split_column`` (else ``run_data.split_column``) holds it, or the split's folder of the splits ``datasets``
    saved. ``run_data``: the run's ``data`` settings, whose layout (``format``, ``has_header``,
    ``column_names``) reads a CSV or TSV file whose first line does not name the text column, as the run read
    its own headerless files. ``kind``: the file's kind (:func:`file_kind`) where the caller has told it, so that
    a ``.txt`` file is read as the caller's checks took it.

    ``.txt`` holds one text per line: each line is a row ``{"text": line}``,
    blank lines included (they get an empty prediction), so output rows line
    up with input lines; ``-`` reads such lines from standard input. The others are read by
    :func:`finetune.local_files.read_table`, as training data is, and must hold
    ``text_column`` (a CSV/TSV header, or a JSON key). Text is read in ``encoding`` (``data.encoding``'s names), a
    CSV or TSV file's quotes as ``quoting`` (``data.quoting``'s settings; None: ``auto``) says; a workbook's
    ``sheet`` (None: its first).

    Raises:
        DataError: naming the file (and line or column) if it is missing, has
            an unsupported extension, lacks the column, or holds a bad line.
    """
    from finetune.config import DataConfig
    from finetune.column_hints import PANDAS_JSON_HINT, pandas_layout
    from finetune.local_files import read_table
    given = str(path)
    stdin = given == STDIN
    local = Path(local_file(given))  # a URL or an archive is read from its copy,
    path = given if str(local) != given else local  # and named as given
    suffix = kind or (".txt" if stdin else file_kind(local, encoding, text_column, run_data))
    if suffix == ".tsv" and inner_suffix(local) == ".txt" and is_main_rank():
        print(f"note: {path}: its lines split on tabs alike, as a table's: read as training reads such a file, "
              f"by its columns", file=sys.stderr)
    if sheet is not None and suffix not in WORKBOOKS:  # read on, it would be ignored
        raise ConfigError(f"--sheet: names a sheet of an .xlsx --file, and {path} is not one")
    if split is not None and suffix in ONE_TEXT_EACH:
        raise ConfigError(f"--split {split}: names a split of a file's rows, and {path} holds single texts")
    if split is not None and saved_by_datasets(local) == "dict":  # each split a folder of its own
        if saved_by_datasets(local / split) != "dataset":
            splits = sorted(p.name for p in local.iterdir() if saved_by_datasets(p) == "dataset")
            raise DataError(f"--split: {path} has no split {split!r} (splits: {', '.join(splits)})")
        return read_rows(local / split, text_column, text_pair_column, encoding)
    if suffix in ONE_TEXT_EACH:
        if text_pair_column:
            what = "standard input" if stdin else "a .txt file" if suffix == ".txt" else "a folder of .txt files"
            raise DataError(f"--file {path}: {what} holds single texts; this model takes pairs (use .csv or "
                            f".jsonl with a {text_pair_column!r} column)")
        rows = _text_files(local, encoding) if suffix == TEXT_FOLDER else \
            _text_lines(sys.stdin.buffer if stdin else local, path, encoding)
    else:
        # the readers training uses: the same formats, quoting and encoding checks
        columns = (text_column, *([text_pair_column] if text_pair_column else []))
        table = read_table(str(path), "--file", DataConfig(train_file=str(path), encoding=encoding, sheet=sheet,
                                                           text_column=text_column, quoting=quoting or "auto",
                                                           **runs_layout(path, columns, encoding, run_data)),
                           "--encoding", columns=columns)
        if pandas_layout(table):  # its one row would be classified as the text of a mapping
            raise DataError(f"--file {path}: a table written by columns, not rows", hint=PANDAS_JSON_HINT)
        _refuse_columns_without_texts(table, path, suffix, [(text_column, "--text")] + (
            [(text_pair_column, "--text-pair")] if text_pair_column else []))
        if split is not None:
            split_column = split_column or (run_data.split_column if run_data is not None else None)
        rows = table.to_list() if split is None else rows_of_split(table, split, split_column, path)
    if not any(_text(row, text_column) for row in rows):
        raise DataError(f"--file {path}{'' if split is None else f'[{split}]'}: no texts in it")
    return rows


def _refuse_columns_without_texts(table, path, suffix: str, named: list[tuple[str, str]]) -> None:
    """Stop where a column ``named`` (with the option that names it) is not among the ``table``'s, read from a
    ``suffix`` file, or holds lists or mappings, not texts (training refuses it: its JSON would be classified)."""
    from finetune.column_hints import named_like
    from finetune.tables import feature_name, lists_or_mappings

    if suffix in WORKBOOKS:
        where = "in the header row"
    elif EXTENSIONS.get(suffix) in ("csv", "tsv"):
        where = "in the header"
    else:
        where = "among the columns" if suffix in (".parquet", SAVED) else "among the keys"
    for column, flag in named:
        if column not in table.column_names:
            like = named_like(column, table.column_names)
            raise DataError(f"--file {path}: no column {column!r} {where} "
                            f"({', '.join(table.column_names) or 'empty'}); pass {flag}",
                            hint=f"by the name, try {flag} {like}" if like else None)
        if lists_or_mappings(table.features[column]):
            raise DataError(f"--file {path}: column {column!r} holds {feature_name(table.features[column])}, "
                            f"not texts", hint=f"name the column of the texts with {flag}")


def runs_layout(path, columns: Sequence[str], encoding: str, run_data) -> dict[str, Any]:
    """The run's layout settings where it read headerless files (``data.column_names``) and the file's first line
    is a row of as many fields, not a header naming ``columns``; else none, and the file is read by its header.
    A file read so is said in a note: a header of other names would have been read as a row."""
    names = run_data.column_names if run_data is not None else None
    delimiter = {"tsv": "\t", "csv": ","}.get(run_data.format) if names else None  # as the run's format splits
    fields = first_line_fields(path, encoding, delimiter) if names else None
    if fields is None or set(columns) <= {field.strip() for field in fields} or len(fields) != len(names):
        return {}
    if is_main_rank():  # each process of a launch reads the file; the first says it
        print(f"note: {path}: its first line names no column {columns[0]!r}: read as the run's data was, without a "
              f"header, its columns {', '.join(names)}", file=sys.stderr)
    return {"format": run_data.format, "has_header": run_data.has_header, "column_names": names}


def first_line_fields(file: str | os.PathLike, encoding: str = "utf-8", delimiter: Optional[str] = None
                      ) -> Optional[list[str]]:
    """The fields of a CSV or TSV file's first line, split at ``delimiter`` (``None``: at its tabs where it has
    one, else at its commas); ``None`` for a file that says its own layout (a folder, a JSON Lines, JSON or
    Parquet file, a workbook); none where it is neither, or cannot be read."""
    path = data_path(str(file), "--file")  # a URL's downloaded copy
    if path.is_dir() or inner_suffix(path) in (".jsonl", ".json", ".parquet") or path.suffix.lower() in WORKBOOKS:
        return None
    if inner_suffix(path) not in (".csv", ".tsv", ".tab", ".txt") or not path.is_file():
        return []
    try:
        with open_text(path, encoding, errors="replace") as fh:
            first = fh.readline()
    except (LookupError, UnicodeError, DataError):  # an unknown encoding, no text in it, damaged: the read says
        return []
    return next(csv.reader([first], delimiter=delimiter or ("\t" if "\t" in first else ",")), [])


def rows_of_split(table, split: str, column: Optional[str], path) -> list[dict[str, Any]]:
    """The rows of ``table`` whose ``column`` holds ``split`` (the spaces around a value not part of it, as
    training reads its ``data.split_column``), in order."""
    if column is None:
        raise ConfigError(f"--split {split}: the run names no column of splits (data.split_column); name the "
                          f"file's with --split-column")
    if column not in table.column_names:
        raise DataError(f"--file {path}: no column {column!r} of splits (--split-column, else the run's "
                        f"data.split_column); columns found: {', '.join(table.column_names)}")
    from finetune.split_column import split_name  # beside datasets, which read the table

    names = [split_name(value) for value in table[column]]
    if split not in names:
        found = dict.fromkeys(name for name in names if name)  # in the order the file has them
        raise DataError(f"--split: {path}'s column {column!r} has no split {split!r} (splits: {', '.join(found)})")
    return [row for row, name in zip(table.to_list(), names) if name == split]


def _text_lines(source, path: str | Path, encoding: str) -> list[dict[str, Any]]:
    """``{"text": line}`` for each line of a file or a binary stream, read in ``encoding`` (a UTF-8 BOM dropped)."""
    from finetune.text_encoding import decoded

    if isinstance(source, Path):
        with open_bytes(source) as fh:
            raw = fh.read()
    else:
        raw = source.read()
    # decoded whole, so that an error's offset is the file's, not that of a buffered chunk
    text = decoded(raw, f"--file {path}", encoding, flag="--encoding")
    # newline="": split at \n, \r and \r\n, as a file opened so is read
    return [{"text": line.rstrip("\r\n")} for line in io.StringIO(text, newline="")]


def _text(row: dict[str, Any], column: Optional[str]) -> str:
    value = row.get(column) if column else None
    return "" if value is None else str(value)


# what a prediction adds to its row: label (single label), labels (multi-label), score, probabilities
PREDICTED = ("label", "labels", "score", "probabilities")
# put in front of each of them where the input has a column of their names (a labelled file's `label`); where it
# has those too (a file of earlier predictions), a number follows: predicted_2_, predicted_3_, ...
CLASH_PREFIX = "predicted_"


def prediction_prefix(rows: list[dict[str, Any]], labels: Sequence[str]) -> tuple[str, list[str]]:
    """The prefix of the prediction's columns, and the input's columns that took it there.

    None where the input has no column of their names; else the first of
    :data:`CLASH_PREFIX`, ``predicted_2_``, ``predicted_3_``, ... under which
    it has none. A labelled test file has a ``label`` column, which written
    under the same name the prediction would replace in the output; a file
    of earlier predictions (another model's, say) has ``predicted_label``
    as well, whose values would be lost the same way.
    """
    columns, clashes = {key for row in rows for key in row}, []
    for prefix in itertools.chain(("", CLASH_PREFIX), (f"{CLASH_PREFIX}{n}_" for n in itertools.count(2))):
        named = columns & {*(prefix + name for name in PREDICTED), *(f"{prefix}prob_{name}" for name in labels)}
        if not named:
            return prefix, clashes
        clashes += sorted(named)
    raise AssertionError("unreachable: the prefixes go on")


def note_the_files_own_columns(file: str, output_dir: str, rows: list[dict], clashes: list[str], prefix: str,
                               label_column: Optional[str | list[str]]) -> None:
    """Say on stderr what ``--file``'s own columns change: names the prediction's columns would take (which then
    take ``prefix``), and the run's label column, whose labels ``finetune score`` compares."""
    if clashes:
        quoted = [repr(column) for column in clashes]
        named = ", ".join(quoted[:-1]) + " and " + quoted[-1] if len(quoted) > 1 else quoted[0]
        print(f"note: {file} has its own {named} column{'s' if len(clashes) > 1 else ''}, kept as "
              f"{'they are' if len(clashes) > 1 else 'it is'}: the prediction's columns are named "
              f"{prefix}<name> ({prefix}label, {prefix}score, ...)", file=sys.stderr)
    # a file has its columns on every row
    if label_column is not None and all(column in rows[0] for column in label_columns(label_column)):
        named = f"label column {label_column!r}" if isinstance(label_column, str) else "label columns"
        print(f"note: {file} has the run's {named}: finetune score {output_dir} --file {file} scores the model on it",
              file=sys.stderr)


def predict_rows(predictor, rows: list[dict[str, Any]], text_column: str,
                 text_pair_column: Optional[str] = None, progress: bool = False,
                 prefix: str = "", kept: bool = True) -> list[dict[str, Any]]:
    """Each row with its ``label``, ``score`` and ``probabilities`` added by ``predictor`` (a
    :class:`finetune.predictor.Predictor`), each name after ``prefix``; an empty text gets empty ones.

    ``kept=False``: a launched process whose rows another writes runs its share of the batches, which the
    processes gather together, and builds no row (none is returned): a million rows' dicts on every GPU's
    process would be memory and time spent on nothing."""
    texts = [_text(row, text_column) for row in rows]
    pairs = [_text(row, text_pair_column) for row in rows] if text_pair_column else None
    filled = [i for i, text in enumerate(texts) if text.strip()]
    filled_texts, filled_pairs = [texts[i] for i in filled], [pairs[i] for i in filled] if pairs else None
    if not kept:
        predictor.logits(filled_texts, filled_pairs, progress)
        return []
    predictions = predictor.predict(filled_texts, filled_pairs, progress)
    empty = _prefixed(predictor.empty_prediction(), prefix)
    out = [{**row, **empty} for row in rows]
    for i, prediction in zip(filled, predictions):
        out[i] = {**rows[i], **_prefixed(prediction, prefix)}
    return out


def _prefixed(prediction: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {f"{prefix}{key}": value for key, value in prediction.items()}
