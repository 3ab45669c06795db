"""How a data file's bytes become text: its compression (``reviews.csv.gz``) and its encoding (``data.encoding``,
``finetune predict --encoding``).

Kept apart from :mod:`finetune.data` so that a setting is checked, and a header peeked at, without importing
``datasets``.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import io
import lzma
from pathlib import Path
from typing import BinaryIO, Iterator, Optional, TextIO

from finetune.errors import ConfigError, DataError

# a file compressed whole, by its last extension: datasets' readers decompress these themselves, and every check
# that reads the bytes before them opens the file through `open_bytes`, so both read the same text. zstd is not
# among them: Python's standard library reads it from 3.14 only, and datasets needs the zstandard package for it.
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_CHECKS = {".gz": "gzip -t", ".bz2": "bzip2 -t", ".xz": "xz -t"}


def check_encoding(name: str, key: str) -> None:
    """Raise a one-line ConfigError naming ``key`` where ``name`` is no codec Python knows."""
    try:
        codecs.lookup(name)
    except LookupError:
        raise ConfigError(f"{key}: {name!r} is no text encoding Python knows (utf-8, cp1252, latin-1, utf-16, "
                          f"...)") from None


def is_utf8(name: str) -> bool:
    return codecs.lookup(name).name == "utf-8"


def undecodable(where: str, offset: int, encoding: str, flag: str = "data.encoding") -> DataError:
    """The one-line error of a file that is not ``encoding`` text (``where``: the file, as the message names it),
    naming the setting that gives a file's encoding (``flag``: ``data.encoding``, or a command's option)."""
    utf8 = is_utf8(encoding)
    replace = ", or data.encoding_errors: replace to substitute U+FFFD for undecodable bytes" if flag.startswith(
        "data.") else ""
    return DataError(
        f"{where}: not {'UTF-8' if utf8 else encoding} text (byte offset {offset}); set {flag} to the file's{replace}",
        # a spreadsheet's plain "CSV" on Windows is Windows-1252: reading it as such keeps its accents
        hint=f"a spreadsheet's plain CSV on Windows is {flag}{' ' if flag.startswith('--') else '='}cp1252"
        if utf8 else None,
    )


# the byte-order marks that declare a file UTF-16 or UTF-32 (Excel's "Unicode Text" export, PowerShell's `>`): no
# UTF-8 text starts with one. UTF-32's come first, since its little-endian mark starts with UTF-16's.
MARKS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF16_LE, "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16"))


def marked_encoding(path: Path, encoding: str) -> str:
    """``encoding``; where that is UTF-8 (the default), the UTF-16 or UTF-32 whose byte-order mark the file starts
    with, if it does."""
    if not is_utf8(encoding):
        return encoding
    with open_bytes(path) as fh:
        return _marked(fh.read(4), encoding)


def _marked(start: bytes, encoding: str) -> str:
    """``encoding``, or where it is UTF-8 the UTF-16 or UTF-32 whose byte-order mark ``start`` begins with."""
    if not is_utf8(encoding):
        return encoding
    return next((name for mark, name in MARKS if start.startswith(mark)), encoding)


def python_codec(name: str) -> str:
    """The codec that reads text in ``name``: UTF-8 as ``utf-8-sig``, which drops a byte-order mark that would
    otherwise glue onto the first column name."""
    return "utf-8-sig" if is_utf8(name) else name


def decode_whole(raw: bytes, encoding: str, errors: str = "strict") -> str:
    """A whole file's bytes as text, by the rule its streaming readers follow (a UTF-8 byte-order mark
    dropped, UTF-16 without one refused, UTF-16's or UTF-32's read as it says where ``encoding`` is UTF-8), so a
    class folder's ``.txt`` or predict's reads as a CSV would.

    Raises:
        UnicodeError: where ``raw`` is not ``encoding`` text (``.start``: the offset, when there is one).
    """
    # bytes.decode("utf-16") takes the machine's byte order where the mark is missing; a stream decoder refuses
    return codecs.getincrementaldecoder(python_codec(_marked(raw[:4], encoding)))(errors).decode(raw, final=True)


def decoded(raw: bytes, where: str, encoding: str, errors: str = "strict", flag: str = "data.encoding") -> str:
    """A whole file's bytes as text (:func:`decode_whole`), or the one-line error naming ``where``, the offset and
    ``flag`` (:func:`undecodable`)."""
    try:
        return decode_whole(raw, encoding, errors)
    except UnicodeError as exc:  # a UnicodeDecodeError, or UTF-16's missing byte-order mark (offset 0)
        raise undecodable(where, getattr(exc, "start", 0), encoding, flag) from None


def compression_of(path: Path) -> Optional[str]:
    """``path``'s compression (``.gz``, ``.bz2``, ``.xz``), or None for a plain file."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def inner_suffix(path: Path) -> str:
    """The lower-case extension of the file ``path`` holds: ``.csv`` for ``reviews.csv`` and ``reviews.csv.gz``
    alike, ``""`` for ``reviews.gz``."""
    return Path(path.stem).suffix.lower() if compression_of(path) else path.suffix.lower()


@contextlib.contextmanager
def open_bytes(path: Path) -> Iterator[BinaryIO]:
    """``path`` opened to read its bytes, decompressed where its extension names a compression.

    Raises:
        DataError: naming the file where its compressed bytes are damaged or cut short (found as they are read,
            so the reads in the ``with`` block are covered too).
    """
    compression = compression_of(path)
    if compression is None:
        with open(path, "rb") as fh:
            yield fh
        return
    try:
        with COMPRESSIONS[compression](path, "rb") as fh:
            yield fh
    except (OSError, EOFError, lzma.LZMAError) as exc:  # gzip.BadGzipFile is an OSError; a cut file ends in EOFError
        raise DataError(f"{path}: not a readable {compression} file ({type(exc).__name__}: {exc or 'cut short'})",
                        hint=f"{_CHECKS[compression]} {path} tests it") from None


@contextlib.contextmanager
def open_text(path: Path, encoding: str, errors: str = "strict") -> Iterator[TextIO]:
    """``path`` opened as text in ``encoding`` (:func:`python_codec`'s, lines as the csv module wants them:
    ``newline=""``), decompressed as :func:`open_bytes` does."""
    with open_bytes(path) as raw:
        yield io.TextIOWrapper(raw, encoding=python_codec(encoding), errors=errors, newline="")
