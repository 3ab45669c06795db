"""How a data file's text is decoded (``data.encoding``, ``finetune predict --encoding``).

Kept apart from :mod:`finetune.data` so that a setting is checked, and a header peeked at, without importing
``datasets``.
"""

from __future__ import annotations

import codecs

from finetune.errors import ConfigError, DataError


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


def python_codec(name: str) -> str:
    """The codec that reads text in ``name``: UTF-8 as ``utf-8-sig``, which drops a byte-order mark that would
    otherwise glue onto the first column name."""
    return "utf-8-sig" if is_utf8(name) else name


def decode_whole(raw: bytes, encoding: str, errors: str = "strict") -> str:
    """A whole file's bytes as text, by the rule its streaming readers follow (a UTF-8 byte-order mark
    dropped, UTF-16 without one refused), so a class folder's ``.txt`` or predict's reads as a CSV would.

    Raises:
        UnicodeError: where ``raw`` is not ``encoding`` text (``.start``: the offset, when there is one).
    """
    # bytes.decode("utf-16") takes the machine's byte order where the mark is missing; a stream decoder refuses
    return codecs.getincrementaldecoder(python_codec(encoding))(errors).decode(raw, final=True)
