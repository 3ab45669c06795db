"""Tokenized splits, and the on-disk cache that spares a rerun the tokenizing.

:func:`tokenize_splits` tokenizes every split of :func:`finetune.data.load_splits`
once, truncating but not padding: padding is done per micro-batch by
``transformers.DataCollatorWithPadding``. With a cache folder, each tokenized
split is kept as an Arrow file named by :func:`tokenized_cache_key`, a hash of
everything the tokens depend on, and read back when the same split, tokenizer
and ``max_length`` come again. A large split is tokenized by several processes side
by side (:func:`tokenizing_processes`), to the same tokens.
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Optional, Union

import datasets

from finetune.data import LABELS, TEXT, TEXT_PAIR, content_sha256
from finetune.errors import ConfigError
from finetune.truncation import Truncation

logger = logging.getLogger("finetune.data")


def tokenize_splits(
    splits: datasets.DatasetDict, tokenizer: Any, max_length: int, cache_dir: Optional[str | Path] = None,
    truncation: Optional[Truncation] = None, processes: Union[int, Literal["auto"]] = 1,
    row_digests: Optional[Mapping[str, str]] = None,
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
        processes: How many processes tokenize each split, its rows cut into that many contiguous shards
            (``datasets``' ``num_proc``), or ``auto`` (:func:`tokenizing_processes`); the tokens are the same.
            Cached shards are read back whatever number of processes wrote them.
        row_digests: A split's :func:`~finetune.data.content_sha256`, by split name, where the caller has it (a
            run keeps its training split's to check a resume against): the cache key takes it rather than
            reading the split's rows again (a second or so per 300,000 rows).

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
        key = _split_key(split, settings, (row_digests or {}).get(name)) if settings is not None else None
        cache_file = folder / f"{key}.arrow" if key is not None else None
        shards = tokenizing_processes(processes, len(split))
        if cache_file is not None and any(folder.glob(f"{key}*.arrow")):
            logger.debug("%s split: tokens from %s", name, cache_file)
        elif cache_file is not None:
            logger.debug("%s split: tokenizing %d rows into %s in %d process(es)", name, len(split), cache_file,
                         shards)  # datasets shows a bar
        tokenized[name] = _mapped(split, encode, name, cache_file, key, shards)
    return datasets.DatasetDict(tokenized)


def _mapped(split: datasets.Dataset, encode: Any, name: str, cache_file: Optional[Path], key: Optional[str],
            processes: int) -> datasets.Dataset:
    """``split`` through ``datasets``' ``map(encode)`` on ``processes`` processes, kept in ``cache_file`` (``None``:
    in memory), the text columns dropped.

    With an explicit file name, map() loads it when it exists, and otherwise writes it through a temporary file
    that is renamed when complete; several processes write one file each (``KEY_00000_of_00004.arrow``, ...),
    and map() reads back a complete set of them whatever ``num_proc`` it is given. The key is also the result's
    fingerprint, which spares map() hashing the tokenizer with dill; cut to leave room for the shards' suffix
    within datasets' 64 characters. Without a cache file the tokens stay in memory: map() would otherwise write a
    split read from a file to a file of its own beside it, unasked, and on finding that file again give all its
    rows to one process.
    """
    with tokenizers_parallelism_kept():
        return split.map(
            encode,
            batched=True,
            remove_columns=[column for column in (TEXT, TEXT_PAIR) if column in split.column_names],
            desc=f"Tokenizing {name}",
            cache_file_name=str(cache_file) if cache_file is not None else None,
            load_from_cache_file=cache_file is not None,
            keep_in_memory=cache_file is None,
            new_fingerprint=key[:48] if key is not None else None,
            num_proc=processes if processes > 1 else None,
        )


# The rows from which one more tokenizing process pays for its start (forking, the tokenizer and the shard sent
# to it, its result read back). `python -m bench.tokenizing` times it on a machine: on two cores two processes
# were slower than one at 10,000 of the default job's messages (1.15 s against 0.73), even at 25,000, and faster
# from 50,000 (2.65 s against 3.66; 13.3 against 19.3 at 300,000).
ROWS_PER_PROCESS = 25_000

# In one process a fast tokenizer runs its Rust part on every core and the Python around it on one; a worker
# process runs both on one core. So on a machine of many cores a few workers can be slower than one process:
# auto starts at least this many, or none.
FEWEST_PROCESSES = 3

# Where worker processes start as fresh interpreters (spawn: macOS and Windows; forkserver: Python 3.14's default
# on Linux), each imports the tokenizer's libraries before its first text, seconds whatever the split: on two cores
# two spawned processes were slower than one at 100,000 rows (6.68 s against 5.74), a little faster at 150,000
# (8.31 against 8.99) and faster at 300,000 (14.50 against 19.65; `python -m bench.tokenizing --start-method
# spawn`). auto starts them for splits this large.
ROWS_TO_START_AFRESH = 150_000


def tokenizing_processes(requested: Union[int, Literal["auto"]], rows: int, cores: Optional[int] = None,
                         start_method: Optional[str] = None) -> int:
    """How many processes tokenize a split of ``rows`` rows, as ``data.tokenize_processes`` says.

    A number is that many. ``auto`` is one process per :data:`ROWS_PER_PROCESS` rows, as many as this process's
    share of the machine's cores (:func:`~finetune.launch.cores_per_process`: under a launch each process tokenizes
    with its share), and 1 where that comes to fewer than :data:`FEWEST_PROCESSES` on a machine of more cores, or
    where the processes would start afresh (:func:`workers_start_method`) for fewer than
    :data:`ROWS_TO_START_AFRESH` rows.

    Args:
        requested: ``auto`` or a number of processes.
        rows: The split's rows.
        cores: CPU cores available (default: :func:`~finetune.machine.available_cores`); for tests.
        start_method: How the processes would start (default: :func:`workers_start_method`); for tests.
    """
    if requested != "auto":
        return int(requested)
    from finetune.launch import cores_per_process, launched_world_size

    if rows < ROWS_TO_START_AFRESH and (start_method or workers_start_method()) != "fork":
        return 1
    share = max(1, cores_per_process(launched_world_size(), cores))
    processes = min(share, rows // ROWS_PER_PROCESS)
    return processes if processes >= min(share, FEWEST_PROCESSES) else 1


def workers_start_method() -> str:
    """How ``datasets``' ``map(num_proc=)`` starts its processes here: ``fork``, ``spawn`` or ``forkserver``, the
    method this program set or else the platform's default, read without settling it for the program."""
    import multiprocess  # what datasets starts its processes with (the standard library's twin, with dill)

    return multiprocess.get_start_method(allow_none=True) or multiprocess.get_all_start_methods()[0]


@contextmanager
def tokenizers_parallelism_kept() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM`` as it was before the block, in ``os.environ`` and in the environment the
    tokenizers library reads. ``datasets``' ``map(num_proc=)`` sets it to false for the processes it would fork,
    then puts back a copy of ``os.environ`` (which leaves the variable set underneath) or, where every shard came
    from its cache, nothing: the tokenizer would run everything after it in this process (a test set, a
    prediction) on one thread."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
            os.unsetenv("TOKENIZERS_PARALLELISM")  # where os.environ is a copy that no longer holds it
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


# Bump when what tokenize_splits writes, or how its files are keyed, changes, so no run reads an older layout.
# 3: a split's rows enter the key as its content_sha256, which a run computes once for the training split.
_CACHE_LAYOUT = 3


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


def _split_key(split: datasets.Dataset, tokenizer_digest: bytes, rows: Optional[str] = None) -> str:
    """The rows half of :func:`tokenized_cache_key` (the split's :func:`~finetune.data.content_sha256`,
    ``rows`` where the caller has it), joined with the tokenizer's."""
    import hashlib

    return hashlib.sha256(tokenizer_digest + (rows or content_sha256(split)).encode()).hexdigest()


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
