"""A folder of class sub-folders of ``.txt`` files read as a labelled split: each file a text, its folder its label.

``reviews/pos/1.txt`` is a text labelled ``pos``. Two layouts are often
given in its place, and are told so rather than trained on: a folder of
splits (IMDB's ``aclImdb/`` holds ``train/`` and ``test/``, whose few ``.txt``
files are lists of URLs), and a folder of data files (``train.csv``,
``dev.csv``), or one that ``datasets`` saved. A class folder whose name says
its texts have no label (IMDB's ``train/unsup/``) trains as a class like any
other, with a warning that names ``data.drop_labels``, which leaves it out.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import datasets

from finetune.config import DataConfig
from finetune.errors import ConfigError, DataError
from finetune.outputs import is_run_folder
from finetune.resources import saved_by_datasets
from finetune.tables import RAW_LABEL, TEXT, Table
from finetune.text_encoding import decoded

logger = logging.getLogger("finetune.data")

# sub-folder names that are a data set's splits, not its classes
SPLIT_NAMES = ("train", "training", "test", "testing", "validation", "valid", "val", "dev")
# class folder names that say their texts carry no label (IMDB's 50,000 reviews for unsupervised learning)
UNLABELLED_NAMES = ("unsup", "unsupervised", "unlabeled", "unlabelled", "nolabel", "no_label")


def read_class_folders(root: Path, cfg: DataConfig, data_extensions: Sequence[str]) -> Table:
    """Every ``root/<class>/<name>.txt`` as a row: the file's text in ``cfg.encoding``, the folder's name.

    Args:
        root: The folder.
        cfg: The ``data`` section (encoding, and the pair column, which this layout cannot have).
        data_extensions: The extensions of data files, for the hint where ``root`` holds files, not classes.

    Raises:
        DataError: for a folder without ``.txt`` files in its sub-folders, a class folder without any, a
            folder of splits, or a file not in ``cfg.encoding``.
    """
    if cfg.text_pair_column is not None:
        raise ConfigError(f"data.text_pair_column: not supported with the folder layout ({root})")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and not _a_run(p))
    by_class = {c: sorted(f for f in c.iterdir() if f.is_file() and f.suffix.lower() == ".txt") for c in classes}
    if not any(by_class.values()):
        raise DataError(f"{root}: no .txt files in any class sub-folder (expected {root}/<class>/<name>.txt)",
                        hint=_files_in_the_folder(root, data_extensions))
    _refuse_splits(root, [c.name for c in classes])
    _warn_of_unlabelled(root, [c.name for c in classes], cfg.drop_labels)
    texts, labels, files = [], [], []
    for folder, paths in by_class.items():
        if not paths:
            raise DataError(f"{folder}: class folder holds no .txt files")
        for path in paths:
            texts.append(decoded(path.read_bytes(), str(path), cfg.encoding, cfg.encoding_errors))
            labels.append(folder.name)
            files.append(path.relative_to(root).as_posix())
    ds = datasets.Dataset.from_dict(
        {TEXT: texts, RAW_LABEL: labels},
        features=datasets.Features({TEXT: datasets.Value("string"), RAW_LABEL: datasets.Value("string")}),
    )
    return Table.whole(ds, str(root), unit="file", files=files, text_column=TEXT, label_column="sub-folder name")


def _a_run(folder: Path) -> bool:
    """Whether a sub-folder is a run's output (``--output reviews/run``), which is no class: its tokenizer's
    ``vocab.txt`` would otherwise train as one."""
    if not is_run_folder(folder):
        return False
    logger.warning("%s: a run's output folder, not a class: left out of the data (an output folder outside the "
                   "data folder keeps the two apart)", folder)
    return True


def _refuse_splits(root: Path, names: list[str]) -> None:
    """Sub-folders named as splits only (``train``, ``test``) are a data set's splits: each holds the classes."""
    if len(names) < 2 or not all(name.lower() in SPLIT_NAMES for name in names):
        return
    train = next((n for n in names if n.lower() in ("train", "training")), names[0])
    other = next((n for n in names if n != train and n.lower() in ("validation", "valid", "val", "dev")),
                 next(n for n in names if n != train))
    unlabelled = sorted(p.name for p in (root / train).iterdir() if p.is_dir() and p.name.lower() in UNLABELLED_NAMES)
    drop = ""
    if unlabelled:
        drop = f" data.drop_labels=[{','.join(unlabelled)}] (the texts of {root / train / unlabelled[0]} have no label)"
    raise DataError(f"{root}: its sub-folders are splits ({', '.join(names)}), not classes",
                    hint=f"pass the training split's folder: --data {root / train} data.validation_file={root / other}"
                    + drop)


def _warn_of_unlabelled(root: Path, names: list[str], dropped: Optional[list[str]]) -> None:
    for name in names:
        if name.lower() in UNLABELLED_NAMES and name not in (dropped or ()):
            logger.warning("%s: the class folder %r is named as texts without a label, and trains as a class of its "
                           "own; data.drop_labels=[%s] leaves it out if its texts have none", root, name, name)


def _files_in_the_folder(root: Path, data_extensions: Sequence[str]) -> Optional[str]:
    """For a folder given as data that holds data files rather than class sub-folders (``train.csv``,
    ``valid.csv``): the options that name them, the training file by its name, the validation file by its."""
    if saved_by_datasets(root) is not None:
        return "datasets' save_to_disk wrote it, which data.format: auto reads"
    files = sorted(f for f in root.iterdir() if f.is_file() and f.suffix.lower() in data_extensions)
    if not files:
        return None

    def named(*words: str) -> Optional[Path]:
        return next((f for f in files if any(word in f.stem.lower() for word in words)), None)

    train = named("train") or files[0]
    validation = named("valid", "dev", "val")
    also = f" data.validation_file={validation}" if validation is not None and validation != train else ""
    return f"it holds data files ({', '.join(f.name for f in files)}): pass one, --data {train}{also}"
