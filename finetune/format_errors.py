"""The errors of a data file that is not read as it was given, each one line that says what to do instead.

An extension that no reader takes gets a hint for what such a file most often
is (a spreadsheet, lines of text, an archive, a compressed Parquet file, an
Arrow file of datasets'); a header's settings (``data.column_names``,
``data.has_header: false``) given for a file that names its own columns are
refused, where reading on would ignore them without a word.
:mod:`finetune.local_files` raises them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from finetune.config import DataConfig
from finetune.errors import DataError, FileLayoutError
from finetune.resources import EXTENSIONS, WORKBOOKS, saved_by_datasets
from finetune.text_encoding import COMPRESSIONS, compression_of

# what users most often have instead of a text file: the error says how to make one
_SPREADSHEETS = (".xls", ".ods", ".numbers")
# a .txt whose lines hold tab-separated fields reads as TSV; one text per line carries no label
_TEXT_LINES_HINT = ("a .txt file reads when each line holds its fields between tabs (label<TAB>text); texts alone "
                    "go one file per text into a sub-folder per class (--data folder/)")
# a file named without an extension (a spreadsheet's export URL, `.../export?format=csv`) reads once it is named
_NO_EXTENSION_HINT = "without an extension, the format is named: data.format=csv (or tsv, json, parquet)"
# how to unpack what is not read as it is: zstd (the standard library has no reader of it) and the archives that
# finetune.archives does not unpack (the standard library reads neither)
_UNCOMPRESS = {".gz": "gunzip -k", ".bz2": "bunzip2 -k", ".xz": "unxz -k", ".zst": "unzstd"}
_ARCHIVES = {".7z": "7z x", ".rar": "unrar x"}


def unsupported_format(path: Path, suffix: str, key: str) -> DataError:
    """The error of a file whose extension (``suffix``, that of the file it holds where it is compressed) names no
    format read here, with a hint for what it most often is: a spreadsheet, lines of text, an archive..."""
    compression = compression_of(path) or ""
    if suffix == ".parquet":
        return DataError(f"{key}: {path}: a Parquet file compressed again (Parquet compresses its own columns)",
                         hint=f"{_UNCOMPRESS[compression]} {path} writes {path.with_suffix('')}, which reads")
    shown = suffix + compression or "(none)"
    supported = ", ".join(EXTENSIONS)
    if suffix in WORKBOOKS:
        return DataError(f"{key}: {path}: a workbook compressed again (a {suffix} file is a zip archive already)",
                         hint=f"{_UNCOMPRESS[compression]} {path} writes {path.with_suffix('')}, which reads")
    return DataError(
        f"{key}: {path}: unsupported extension {shown!r} (supported: {supported}, each also compressed as "
        f"{', '.join(COMPRESSIONS)}; an Excel workbook: {', '.join(WORKBOOKS)}; or a folder: of class "
        f"sub-folders, or one datasets' save_to_disk wrote; "
        f"or set data.format)",
        hint="save the spreadsheet as an Excel workbook (.xlsx) or as CSV (its File > Save as) and pass that file"
        if suffix in _SPREADSHEETS
        else _TEXT_LINES_HINT if suffix == ".txt" else _arrow_hint(path) if suffix == ".arrow" and not compression
        else _NO_EXTENSION_HINT if not suffix and not compression else _packed_hint(path, suffix, compression),
    )


def _packed_hint(path: Path, suffix: str, compression: str) -> Optional[str]:
    if suffix in _ARCHIVES and not compression:
        return f"an archive: {_ARCHIVES[suffix]} {path}, then pass the file or folder it holds"
    if suffix == ".zst":
        return f"compressed as zstd, which is not read here: {_UNCOMPRESS[suffix]} {path} writes " \
               f"{path.with_suffix('')}, which reads"
    return None


def _arrow_hint(path: Path) -> str:
    if saved_by_datasets(path.parent) == "dataset":
        return f"datasets' save_to_disk wrote it: pass its folder, {path.parent}"
    return "write it as Parquet (datasets.Dataset.from_file(path).to_parquet(...)) and pass that file"


# what each other kind of input names its columns by, for the error that refuses a header's settings on it
_OWN_COLUMNS = {"json": "a JSON file, whose records name their columns",
                "parquet": "a Parquet file, whose schema names its columns",
                "excel": "an Excel workbook, whose first row names its columns",
                "folder": "a folder of class sub-folders, whose texts and labels are its files and sub-folders",
                "saved": "a folder that datasets saved, whose features name its columns",
                "saved splits": "a folder that datasets saved, whose features name its columns"}


def headerless_layout_refused(path: Path, fmt: str, key: str, cfg: DataConfig) -> FileLayoutError:
    """The error for ``data.column_names`` (or ``data.has_header: false``) given for a file that is not CSV/TSV:
    read as it stood, the setting would be ignored without a word."""
    setting = "data.column_names" if cfg.column_names else "data.has_header: false"
    if key == "data.train_file":
        hint = f"leave {setting} out, and name the columns to read with data.text_column and data.label_column"
    else:
        hint = f"{key} is read in data.train_file's layout, which {setting} describes: give it as CSV/TSV in that layout"
    return FileLayoutError(f"{setting}: describes a CSV/TSV file without a header, and {key} {path} is "
                           f"{_OWN_COLUMNS[fmt]}", hint=hint)
