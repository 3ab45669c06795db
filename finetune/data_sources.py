"""Where a run's rows come from, named for people: the start line and the model card say it the same way.

A run trains on a Hub data set's split, a local file, or a split of a data set
``datasets`` saved to a folder, and validates on another split, another file,
or rows held out of the training data. Local
files are named by their file name (a path on one machine means nothing on
another), Hub data sets by their id and configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from finetune.archives import in_an_archive
from finetune.config import DataConfig
from finetune.resources import data_path, file_name, resolve_path, saved_by_datasets


@dataclass(frozen=True)
class DataSources:
    """The training and validation data of a run, in words."""

    # the training data: "glue (sst2)" or a file's name
    train: str
    # the validation data: "glue (sst2) validation split", a file's name, or the rows held out of train
    validation: str
    # the Hub data set id, when the data is one
    hub_id: Optional[str] = None
    hub_config: Optional[str] = None
    # the data set the validation results are on, and its split, as a Hub model card's model-index names them
    results_name: str = ""
    results_split: str = ""
    # whether the validation rows are carved out of the training data (data.validation_split)
    carved: bool = False


def data_sources(cfg: DataConfig, seed: int) -> DataSources:
    """Name the training and validation data of the ``data`` section (``seed``: that of the held-out rows,
    which are stratified by class for single labels, by label for several, by the target's order for a number:
    :mod:`finetune.carve`)."""
    if cfg.dataset_name:
        train = cfg.dataset_name + (f" ({cfg.dataset_config})" if cfg.dataset_config else "")
        hub = {"hub_id": cfg.dataset_name, "hub_config": cfg.dataset_config}
    else:
        train = file_name(cfg.train_file)
        hub = {}
    carved = {"row": "training rows", "text": "distinct training texts"}.get(
        cfg.validation_split_by, f"values of column {cfg.validation_split_by!r} (each with all its rows)")
    if cfg.validation_folds is not None:
        held_out = (f"fold {cfg.validation_fold} of {cfg.validation_folds} of the {carved} held out "
                    f"(stratified, seed {seed})")
    elif cfg.validation_split > 0:
        held_out = f"{cfg.validation_split:.0%} of the {carved} held out (stratified, seed {seed})"
    else:
        held_out = "none"
    if cfg.validation_file:
        name = file_name(cfg.validation_file)
        return DataSources(train, name, results_name=name, results_split="all rows", **hub)
    if cfg.validation_split_name and (cfg.dataset_name or cfg.split_column or _saved_splits(cfg.train_file)):
        return DataSources(train, f"{train} {cfg.validation_split_name} split", results_name=train,
                           results_split=cfg.validation_split_name, **hub)
    return DataSources(train, held_out, results_name=train, results_split=held_out, carved=held_out != "none",
                       **hub)


def _saved_splits(spec: Optional[str]) -> bool:
    """Whether the training data is the splits of a ``DatasetDict`` saved to a folder, which, like a Hub data
    set, may hold its own validation split (an archive's is looked for in its unpacked copy)."""
    if spec is None:
        return False
    path = data_path(spec, "data.train_file") if in_an_archive(spec) else Path(resolve_path(spec))
    return saved_by_datasets(path) == "dict"

