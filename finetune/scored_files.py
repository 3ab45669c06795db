"""The labelled file ``finetune score`` reads: the run's settings it is read with, its rows, and how many of its
texts the run trained on.

The file is read as training read its data, with the ``data`` settings of the run's saved ``config.yaml``; a file
that says its own layout (a folder, a JSON Lines, JSON or Parquet file, a CSV/TSV file whose header names the run's
columns) is read by it instead.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from finetune.errors import ConfigError, DataError
from finetune.outputs import saved_config
from finetune.schema import label_columns

_SCORE_SECTIONS = ("data", "evaluation")
# The labelled file is the only data: no second file, no carve, no caps.
_DATA_FIXED = {"dataset_name": None, "validation_file": None, "validation_split": 0.0, "validation_folds": None,
               "validation_fold": 1, "max_train_samples": None, "max_eval_samples": None, "test_file": None,
               "test_split_name": None, "validation_split_name": None}


def scoring_config(output_dir: str | os.PathLike, file: str | os.PathLike, overrides: Sequence[str] = (),
                   split: Optional[str] = None):
    """The run's saved config with ``data`` pointed at ``file`` and ``overrides`` applied; ``split``: the file's
    split to score (``--split``), held as its test split (``data.test_split_name``), which
    :func:`load_labelled` then reads alone.

    Without a saved ``config.yaml`` the schema's defaults apply (format from
    the extension, columns ``text`` and ``label``, accuracy and macro f1).

    Raises:
        ConfigError: for an override outside ``data.*`` / ``evaluation.*`` or an invalid value.
    """
    from finetune.config import FILE_LAYOUT_KEYS, PER_LABEL, config_from_dict, parse_override, read_yaml
    from finetune.outputs import CONFIG_FILE

    path = Path(output_dir) / CONFIG_FILE
    raw = read_yaml(path) if path.is_file() else {}
    data = dict(raw.get("data") or {})
    data.update(_DATA_FIXED, train_file=str(file), test_split_name=split)
    tree = {"data": data, "evaluation": dict(raw.get("evaluation") or {}),
            # what the run trained decides how its labels are read (a list, a delimited string, a number)
            "model": {"problem_type": (raw.get("model") or {}).get("problem_type", "single_label")}}
    given = set()
    for text in overrides:
        key, value = parse_override(text)
        section, _, name = key.partition(".")
        if section not in _SCORE_SECTIONS or not name or "." in name:
            raise ConfigError(f"override {text!r}: scoring reads only data.<key> and evaluation.<key> settings")
        if section == "data" and name in (*_DATA_FIXED, "train_file"):
            raise ConfigError(f"override {text!r}: the file to score is --file")
        tree[section][name] = value
        given.add(key)
    if tree["model"]["problem_type"] != "regression" and "evaluation.threshold" not in given:
        tree["evaluation"]["threshold"] = PER_LABEL  # the model's own, whatever the run's setting was
    columns = [tree["data"].get("text_column", "text"), *label_columns(tree["data"].get("label_column", "label"))]
    if own_layout(file, columns, str(tree["data"].get("encoding") or "utf-8")):
        # the run's format, header and column names described its training file; this file names its columns.
        # Its encoding, quoting and sheet stay the run's: a header names columns, not how the bytes and quotes are
        # written or where
        for key in FILE_LAYOUT_KEYS:
            if f"data.{key}" not in given and key not in ("encoding", "quoting", "sheet"):
                tree["data"].pop(key, None)
    return config_from_dict(tree, source=f"{path} with --file {file}" if path.is_file() else f"--file {file}")


def own_layout(file: str | os.PathLike, columns: Sequence[str], encoding: str = "utf-8") -> bool:
    """Whether the file says its own layout: a folder (of classes, or saved by datasets), a JSON Lines, JSON or
    Parquet file (its keys), a workbook (its header row), or a CSV/TSV file whose first line names all of
    ``columns``."""
    from finetune.prediction_files import first_line_fields

    fields = first_line_fields(file, encoding)
    return fields is None or set(columns) <= {field.strip() for field in fields}


def layout_hint(data_cfg) -> Optional[str]:
    """How the file was read, when that came from the run's config rather than from the file itself."""
    layout = [f"format: {data_cfg.format}"] if data_cfg.format != "auto" else []
    if data_cfg.column_names:
        layout += ["no header", f"columns {', '.join(data_cfg.column_names)}"]
    return (f"read as the run's data was ({'; '.join(layout)}); a CSV/TSV file whose header names "
            f"{data_cfg.text_column!r} and {data_cfg.label_column!r} is read by its header, or set "
            f"data.format, data.has_header and data.column_names") if layout else None


def load_labelled(file: str | os.PathLike, data_cfg, labels: Sequence[str], problem_type: str = "single_label"):
    """Texts and class ids of a labelled file (of one of its splits, where ``data_cfg`` names one as its test
    split), read with ``finetune.data``'s readers. Unlike training data, the file may hold fewer classes than the
    model knows: its labels are looked up among the model's ``labels``.

    Returns:
        ``(texts, text_pairs or None, class ids)``.

    Raises:
        DataError: naming the file and row for unreadable data, empty texts
            (unless ``data.on_empty_text: drop``) and labels the model does not have.
    """
    from finetune import data as fdata

    label_space = fdata.LabelSpace(list(labels), problem_type, origin="the model")
    if data_cfg.test_split_name is not None:  # --split: that split's rows alone (scoring_config)
        return fdata.labelled_columns(fdata.load_test_split(data_cfg, label_space, key="--split")[0])
    return fdata.labelled_columns(fdata.load_labelled_file(str(file), data_cfg, label_space, key="--file"))


def texts_seen_in_training(runs: str | os.PathLike | Sequence[str | os.PathLike], texts: Sequence[str],
                           pairs: Optional[Sequence[str]] = None) -> Optional[int]:
    """How many of ``texts`` (with their ``pairs``) the run in ``runs`` trained on; of several runs (an ensemble's),
    any of them. ``None`` where a run's training rows cannot be read again (:func:`trained_rows`)."""
    trained = set()
    for run in [runs] if isinstance(runs, (str, os.PathLike)) else runs:
        rows = trained_rows(run)
        if rows is None:
            return None
        trained |= rows
    rows = zip(texts, pairs) if pairs is not None else ((text,) for text in texts)
    return sum(row in trained for row in rows)


def trained_rows(output_dir: str | os.PathLike) -> Optional[set[tuple[str, ...]]]:
    """The rows, ``(text,)`` or ``(text, pair)``, that the run in ``output_dir`` trained on.

    The run's training rows are read again as it read them: from its local training file with its saved
    ``config.yaml`` (the path as given, from the current folder, else the absolute path its ``metrics.json``
    holds), and taken only where they are the rows it trained on (the SHA-256 its ``metrics.json`` holds).
    ``None`` where they cannot be: a Hub data set or a URL, a file moved or edited since, a run saved without them.
    """
    import dataclasses

    from finetune.data import content_sha256, text_rows
    from finetune.errors import FinetuneError
    from finetune.outputs import METRICS_FILE
    from finetune.resources import resolve_path

    try:
        cfg = saved_config(output_dir)
        record = json.loads((Path(output_dir) / METRICS_FILE).read_text(encoding="utf-8"))["train"]
        trained_sha = record["data_sha256"]
        given = cfg.data.train_file if cfg is not None else None
        # the path as given is found from the folder the run started in, its absolute path from any other; a URL's
        # file is not downloaded again to be read
        paths = [path for path in dict.fromkeys((given, record.get("data_file") if given else None))
                 if path is not None and Path(resolve_path(path)).exists()]
    except (FinetuneError, OSError, ValueError, KeyError, TypeError):
        return None
    for path in paths:
        data = dataclasses.replace(cfg.data, train_file=path)
        if data.validation_file:  # without it the run's training rows are the same: a validation file is never carved
            data = dataclasses.replace(data, validation_file=None, validation_split=0.0)
        train = training_rows(data, cfg)
        if train is not None and content_sha256(train) == trained_sha:
            return set(text_rows(train))
    return None


def training_rows(data, cfg):
    """The training split ``load_splits`` reads with ``data`` and the run's seed, quietly; None where it cannot."""
    from finetune.data import load_splits
    from finetune.errors import FinetuneError

    said = logging.getLogger("finetune")
    level = said.level
    said.setLevel(logging.ERROR)  # what the run's start said of its data (rows dropped, say) is not this file's
    try:
        return load_splits(data, cfg.split_seed, cfg.model.problem_type)[0]["train"]
    except FinetuneError:
        return None
    finally:
        said.setLevel(level)
