"""How a data file's text is decoded (``data.encoding``, ``finetune predict --encoding``).

Kept apart from :mod:`finetune.data` so that a setting is checked, and a header peeked at, without importing
``datasets``.
"""

from __future__ import annotations

import codecs

from finetune.errors import ConfigError


def check_encoding(name: str, key: str) -> None:
    """Raise a one-line ConfigError naming ``key`` where ``name`` is no codec Python knows."""
    try:
        codecs.lookup(name)
    except LookupError:
        raise ConfigError(f"{key}: {name!r} is no text encoding Python knows (utf-8, cp1252, latin-1, utf-16, "
                          f"...)") from None


def is_utf8(name: str) -> bool:
    return codecs.lookup(name).name == "utf-8"


def python_codec(name: str) -> str:
    """The codec that reads text in ``name``: UTF-8 as ``utf-8-sig``, which drops a byte-order mark that would
    otherwise glue onto the first column name."""
    return "utf-8-sig" if is_utf8(name) else name
