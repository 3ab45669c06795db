"""Tokenized splits, and the on-disk cache that spares a rerun the tokenizing.

:func:`tokenize_splits` tokenizes every split of :func:`finetune.data.load_splits`
once, truncating but not padding: padding is done per micro-batch by
``transformers.DataCollatorWithPadding``. With a cache folder, each tokenized
split is kept as an Arrow file named by :func:`tokenized_cache_key`, a hash of
everything the tokens depend on, and read back when the same split, tokenizer
and ``max_length`` come again.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Optional

import datasets

from finetune.data import LABELS, TEXT, TEXT_PAIR, digest_rows
from finetune.errors import ConfigError
from finetune.truncation import Truncation

logger = logging.getLogger("finetune.data")


def tokenize_splits(
    splits: datasets.DatasetDict, tokenizer: Any, max_length: int, cache_dir: Optional[str | Path] = None,
    truncation: Optional[Truncation] = None,
) -> datasets.DatasetDict:
    """Tokenize every split once, truncating but not padding.

    Args:
        splits: What :func:`load_splits` returned.
        tokenizer: A ``transformers`` tokenizer.
        max_length: Longest input in tokens (special tokens included); longer
            ones are cut as ``truncation`` says (for pairs, the longer text first).
        cache_dir: Keep each tokenized split in this folder as an Arrow file
            named by :func:`tokenized_cache_key`, and load it from there when
            the same split, tokenizer and ``max_length`` come again (``None``:
            tokenize in memory every time). Only fast tokenizers are cached;
            others are tokenized in memory.
        truncation: What a longer text keeps (:class:`~finetune.truncation.Truncation`); default: its head.

    Returns:
        The splits with ``labels``, ``input_ids``, ``attention_mask``,
        ``token_type_ids`` (when the tokenizer makes them), ``length`` (the
        number of tokens, for length-grouped batching) and ``full_length``
        (the whole text's tokens, to count what was cut); the text columns are
        removed. Padding is left to a ``DataCollatorWithPadding`` per batch.

    Raises:
        ConfigError: ``cache_dir`` cannot be created or written.
    """

    truncation = truncation or Truncation("head", max_length)
    if truncation.max_length != max_length:
        raise ValueError(f"truncation is for max_length {truncation.max_length}, not {max_length}")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = truncation.encode(tokenizer, batch[TEXT], batch.get(TEXT_PAIR))
        if LABELS in batch:
            # handed back rather than left to pass through: datasets passes an untouched column of a split
            # read through an index (a carved validation set's training rows) as one Arrow chunk per row, and
            # casts each chunk as it writes, a fifth of the tokenizing time of a large carved split
            encoded[LABELS] = batch[LABELS]
        return encoded

    folder = prepare_cache_dir(cache_dir) if cache_dir is not None else None
    settings = _tokenizer_digest(tokenizer, truncation) if folder is not None else None
    tokenized = {}
    for name, split in splits.items():
        text_columns = [c for c in (TEXT, TEXT_PAIR) if c in split.column_names]
        key = _split_key(split, settings) if settings is not None else None
        cache_file = str(folder / f"{key}.arrow") if key is not None else None
        if cache_file is not None and Path(cache_file).exists():
            logger.debug("%s split: tokens from %s", name, cache_file)
        elif cache_file is not None:
            logger.debug("%s split: tokenizing %d rows into %s", name, len(split), cache_file)  # datasets shows a bar
        # datasets' own cache: with an explicit file name, map() loads it when it exists, and
        # otherwise writes it through a temporary file that is renamed when complete. Our key is
        # also the result's fingerprint, which spares map() hashing the tokenizer with dill
        # (about 0.6 s per split for a 30k-word vocabulary, more than a cache hit costs).
        tokenized[name] = split.map(
            encode,
            batched=True,
            remove_columns=text_columns,
            desc=f"Tokenizing {name}",
            cache_file_name=cache_file,
            load_from_cache_file=cache_file is not None,
            new_fingerprint=key,
        )
    return datasets.DatasetDict(tokenized)


# Bump when what tokenize_splits writes changes, so no run reads an older layout.
_CACHE_LAYOUT = 2


def tokenized_cache_key(split: datasets.Dataset, tokenizer: Any, max_length: int,
                        truncation: Optional[Truncation] = None) -> Optional[str]:
    """A SHA-256 over everything a tokenized split depends on; ``None`` if the tokenizer cannot be keyed.

    ``datasets`` keys its own cache by a fingerprint of the steps that built a
    split, which for in-memory splits (how :func:`load_splits` returns a file
    read with label checks, carves and subsets) is not stable from one run to
    the next. So the key is written here, from what the result depends on: the
    split's rows and schema (its Arrow data, read in its current order), the
    fast tokenizer's full definition (vocabulary, normalizer, pre-tokenizer,
    post-processor; minus the truncation and padding state that calling it
    changes), the truncation side, the model input names, ``max_length``, what
    a longer text keeps (``data.truncation``, ``data.head_tokens``, ``data.stride``), and
    the versions of the libraries that produce or read the tokens. A change to
    any of them is a different key, so a stale file is never read.
    """
    settings = _tokenizer_digest(tokenizer, truncation or Truncation("head", max_length))
    return None if settings is None else _split_key(split, settings)


def _tokenizer_digest(tokenizer: Any, truncation: Truncation) -> Optional[bytes]:
    """The tokenizer-and-settings half of :func:`tokenized_cache_key`."""
    import hashlib
    import json

    import tokenizers
    import transformers

    from finetune import __version__

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (pure Python) tokenizer: no stable definition to hash
        return None
    definition = json.loads(backend.to_str())
    definition.pop("truncation", None)
    definition.pop("padding", None)
    settings = {
        "layout": _CACHE_LAYOUT,
        "finetune": __version__,
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
        "tokenizer_class": type(tokenizer).__name__,
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "model_input_names": list(getattr(tokenizer, "model_input_names", [])),
        "max_length": truncation.max_length,
        "truncation": truncation.key(),
        "definition": definition,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()


def _split_key(split: datasets.Dataset, tokenizer_digest: bytes) -> str:
    """The rows half of :func:`tokenized_cache_key`, joined with the tokenizer's."""
    import hashlib

    digest = hashlib.sha256(tokenizer_digest)
    digest_rows(digest, split)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """Where tokenized splits are kept unless ``data.cache_dir`` says otherwise: beside the ``datasets`` cache."""
    return Path(datasets.config.HF_DATASETS_CACHE) / "finetune-tokenized"


def prepare_cache_dir(cache_dir: str | Path) -> Path:
    """Create the tokenized-split cache folder and check that it can be written; returns its path.

    Raises:
        ConfigError: It cannot be created or written (one line naming the folder).
    """
    folder = Path(cache_dir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # the files are written the same way: a temporary, then renamed
            pass
    except OSError as exc:
        raise ConfigError(
            f"data.cache_dir: cannot write tokenized splits to {folder} ({exc.strerror or exc}); "
            f"set data.cache_dir to another folder or data.cache_tokenized: false"
        ) from None
    return folder
