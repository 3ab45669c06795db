"""Labelled texts in, tokenized ``datasets`` splits out.

:func:`load_splits` reads the train (and validation) data named by a
:class:`~finetune.config.DataConfig` through the ``datasets`` library and
returns a ``DatasetDict`` whose splits all have the same columns: ``text``,
optionally ``text_pair``, and ``labels`` (a ``ClassLabel`` of class ids), plus
the :class:`~finetune.labels.LabelSpace` mapping ids to names
(:mod:`finetune.labels` makes the ids; :func:`finetune.tokens.tokenize_splits`
then tokenizes the splits).

Sources:

- Local files (``data.train_file`` / ``data.validation_file``, ``pkg:`` specs
  allowed): CSV, TSV, JSON or JSON Lines, Parquet, a folder with one
  sub-folder per class, or a folder ``datasets`` saved (a ``DatasetDict``'s
  splits chosen as a Hub data set's), read by :mod:`finetune.local_files`.
- Hub data sets (``data.dataset_name``), read with ``datasets.load_dataset``.
- A test set (``data.test_file``, or a data set's ``data.test_split_name``):
  :func:`load_test_split`, read as validation data is and scored after training
  (:mod:`finetune.test_set`).

Decisions worth knowing:

- Error messages count rows as a user counts them in the file: ``line N`` for
  CSV/TSV (the header is line 1) and JSON Lines, ``record N`` for a JSON
  array, ``row N`` (1-based) for Parquet and Hub splits, and the file's path
  for the folder layout. A CSV field spanning several lines shifts the line
  numbers after it. Blank lines in CSV/TSV files are skipped.
- With ``data.on_empty_text: drop`` the dropped rows are reported by a
  ``WARNING`` record of this module's logger (``finetune.data``), naming the
  file, the count and the first few rows.
- Without ``data.validation_file`` (or a Hub validation split),
  ``data.validation_split`` of the train rows (rounded up, and at least one
  per class) is carved out, stratified (by class, by label, or by the target's
  order) and seeded with ``seed``; with
  ``data.validation_split_by: text``, of its distinct texts (:mod:`finetune.carve`).
- ``data.max_train_samples`` / ``data.max_eval_samples`` keep a random subset
  drawn with ``seed`` after the validation carve, in the split's order. A
  random subset rather than the first rows, because files are often sorted by
  class (the folder layout always is) and the first rows would be one class.
"""

from __future__ import annotations

import logging
from typing import Optional

import datasets
import numpy as np
import pyarrow as pa

from finetune.carve import carve_fold, carve_validation, not_a_label_column, subset
from finetune.columns import read_column
from finetune.config import DataConfig
from finetune.errors import ConfigError, DataError, root_message
from finetune.label_columns import warn_of_columns_without_ones
from finetune.labels import LabelSpace, encode_against, encode_train, leave_out_labels, leave_out_unlabelled
from finetune.local_files import read_local, read_saved_splits
from finetune.schema import label_columns
from finetune.split_column import named_split, rows_by_split, say_splits_left_out, warn_of_a_split_column
from finetune.standard_columns import drop_or_reject_empty_texts, standardize
from finetune.tables import GROUP, LABELS, RAW_LABEL, SHOW_LABELS, TEXT, TEXT_PAIR, Table, short_list

__all__ = ["LABELS", "TEXT", "TEXT_PAIR", "LabelSpace", "load_splits", "load_labelled_file", "load_test_split",
           "labelled_columns",
           "class_counts", "content_sha256", "digest_rows", "rows_seen_in", "text_rows"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- public API


def load_splits(cfg: DataConfig, seed: int, problem_type: str = "single_label", head: Optional[list[str]] = None
                ) -> tuple[datasets.DatasetDict, LabelSpace]:
    """Load train and validation data with uniform columns and class ids.

    Args:
        cfg: The ``data`` section of the config.
        seed: Seeds the validation carve and the ``max_*_samples`` subsets, so
            the same seed gives the same splits.
        head: The classes of the trained head the run starts from
            (:func:`finetune.modeling.trained_head_labels`), whose order the label ids take where they are
            the data's.

    Returns:
        ``(splits, label_space)``. ``splits`` has ``"train"`` and, unless
        ``validation_split`` is 0 without folds and no validation data is
        given, ``"validation"``; each with columns ``text``, ``text_pair`` (only with
        ``data.text_pair_column``) and ``labels``: a ``ClassLabel`` whose
        names are ``label_space.names`` (single_label), a 0/1 float vector
        over them (multi_label), or a float (regression). ``label_space``
        comes from the train data: a ``ClassLabel``'s names in order, else the
        distinct labels sorted (integers numerically).

    Raises:
        DataError: one line naming the file (and row, column or label) for any
            missing, unreadable or malformed data.
        ConfigError: for column settings that contradict each other.
    """
    _check_column_settings(cfg)
    if cfg.train_file is not None:
        train, validation = _load_local_train(cfg)
    else:
        train, validation = _load_hub(cfg)
    if cfg.validation_file is not None:
        validation = _load_local(cfg.validation_file, "data.validation_file", cfg)

    train = _rows_to_encode(train, cfg, problem_type, training=True)  # the encoded rows, which the carve names
    encoded, label_space = encode_train(train, problem_type, cfg.label_delimiter, cfg.label_map, cfg.drop_labels,
                                        head)
    if not isinstance(cfg.label_column, str) and cfg.label_map is None:
        warn_of_columns_without_ones(train.source, cfg.label_column, label_space.names, cfg.drop_labels)
    splits = {"train": encoded}

    if cfg.validation_folds and validation is not None:
        raise DataError(f"data.validation_folds: {train.source} has a validation split of its own "
                        f"({cfg.validation_split_name}), and folds are cut from the training data",
                        hint="data.validation_split_name=null cuts the folds from the training split alone")
    carve = validation is None and _carves(cfg)
    if not carve and label_space.problem_type == "single_label":
        # no carve to refuse a column that is no label column (it needs two rows a class): the run goes on,
        # but not without a word, said before a validation file's labels are looked up in these
        not_labels = not_a_label_column(class_counts(encoded, len(label_space)), train)
        if not_labels is not None:
            logger.warning("%s (%s)", not_labels.message, not_labels.hint)
    if validation is not None:
        splits["validation"] = _encode_against(validation, cfg, label_space)
    elif carve:
        splits["train"], splits["validation"] = _carve(splits["train"], train, cfg, seed, label_space)

    splits = {name: split.remove_columns(GROUP) if GROUP in split.column_names else split
              for name, split in splits.items()}  # read by the carve; no column of a run's data
    splits["train"] = subset(splits["train"], cfg.max_train_samples, seed)
    if "validation" in splits:
        splits["validation"] = subset(splits["validation"], cfg.max_eval_samples, seed)
    logger.debug(  # the start line says it too
        "data: %d train rows, %s validation rows, %d classes (%s)",
        len(splits["train"]),
        len(splits["validation"]) if "validation" in splits else "no",
        len(label_space),
        short_list(label_space.names, SHOW_LABELS),
    )
    return datasets.DatasetDict(splits), label_space


def load_labelled_file(spec: str, cfg: DataConfig, label_space: LabelSpace, key: str = "data.validation_file"
                       ) -> datasets.Dataset:
    """Read one labelled file against a label space that is already known.

    What a validation file goes through, and what scoring a saved model on a
    file needs: the file may hold fewer classes than ``label_space``, but a
    label outside it is an error.

    Args:
        spec: Path (or ``pkg:`` spec) of a CSV/TSV/JSON/Parquet file or class folder.
        cfg: The ``data`` section (format, columns, empty-text and encoding policies).
        label_space: The classes, e.g. the trained model's.
        key: What to call the file in error messages (a config key or a CLI flag).

    Returns:
        A ``Dataset`` with ``text``, optionally ``text_pair``, and ``labels`` (class ids).

    Raises:
        DataError: naming the file and row for unreadable data, empty texts
            (unless ``data.on_empty_text: drop``) and labels outside ``label_space``.
    """
    _check_column_settings(cfg)
    return _encode_against(_load_local(spec, key, cfg), cfg, label_space)


TEST_KEY = "data.test_split_name"


def load_test_split(cfg: DataConfig, label_space: LabelSpace, key: str = TEST_KEY
                    ) -> Optional[tuple[datasets.Dataset, str]]:
    """The test set ``data.test_file`` or ``data.test_split_name`` names, read as a validation file is (its labels
    looked up among the training data's), and where it came from (the file as given, or ``glue/sst2[test]``);
    ``None`` without one. ``key``: what errors call the split's setting (``finetune score``'s ``--split``).

    Raises:
        DataError: naming the file, split or row, as for validation data.
        ConfigError: for ``data.test_split_name`` where the training data is one file, not a data set of splits.
    """
    if cfg.test_file is not None:
        return _encode_against(_load_local(cfg.test_file, "data.test_file", cfg), cfg, label_space), cfg.test_file
    if cfg.test_split_name is None:
        return None
    split = cfg.test_split_name
    named = None  # what the run's test set is called, where not the split's table's name
    if cfg.dataset_name is not None:
        loaded, shown = _hub_splits(cfg)
        tables = _tables_of(loaded, shown)
    elif cfg.split_column is not None:
        tables, shown, named = _file_splits(cfg), _split_column_of(cfg), named_split(cfg.train_file, split)
    else:
        loaded, shown = read_saved_splits(cfg.train_file, "data.train_file", cfg.format), cfg.train_file
        if loaded is None:
            own_file = "give the test rows as a file of their own: data.test_file=..., or " if key == TEST_KEY else ""
            raise ConfigError(f"{key}: {cfg.train_file} is one file, not a data set of splits",
                              hint=f"{own_file}name the column of each row's split: data.split_column=...")
        tables = _tables_of(loaded, shown)
    if split not in tables:
        raise DataError(f"{key}: {shown} has no split {split!r} (splits: {', '.join(tables)})")
    if len(tables[split].ds) == 0:
        raise DataError(f"{shown}[{split}]: no rows")
    table = standardize(tables[split], cfg.text_column, cfg.text_pair_column, cfg.label_column)
    if isinstance(table.ds.features[RAW_LABEL], datasets.ClassLabel) and max(read_column(table.ds, RAW_LABEL)) < 0:
        raise DataError(f"{key}: {shown}[{split}] has no labels (every row's is -1: a benchmark keeps its test "
                        f"labels for its leaderboard)",
                        hint=f"take its validation split as the test set, and carve the validation rows from "
                             f"{cfg.train_split}: data.test_split_name={cfg.validation_split_name or 'validation'} "
                             f"data.validation_split_name=null" if key == TEST_KEY else None)
    return _encode_against(table, cfg, label_space), named or f"{shown}[{split}]"


def labelled_columns(ds: datasets.Dataset) -> tuple[list, Optional[list], list]:
    """A labelled data set's texts, its second texts (``None`` without pairs) and its labels, as lists."""
    pairs = read_column(ds, TEXT_PAIR) if TEXT_PAIR in ds.column_names else None
    return read_column(ds, TEXT), pairs, read_column(ds, LABELS)


def _encode_against(table: Table, cfg: DataConfig, label_space: LabelSpace) -> datasets.Dataset:
    table = _rows_to_encode(table, cfg, label_space.problem_type, training=False)
    return encode_against(table, label_space, cfg.label_delimiter, cfg.label_map, cfg.drop_labels)


def _rows_to_encode(table: Table, cfg: DataConfig, problem_type: str, training: bool) -> Table:
    """The rows whose labels are encoded: ``data.on_empty_text``, ``data.on_missing_label`` and (a single label's
    rows) ``data.drop_labels`` applied; ``training``: the training split, whose labels the settings name."""
    table = drop_or_reject_empty_texts(table, cfg.on_empty_text)
    table = leave_out_unlabelled(table, cfg.on_missing_label, problem_type, cfg.label_delimiter)
    return leave_out_labels(table, cfg.drop_labels, problem_type, training)


# --------------------------------------------------------------------------- local files (finetune.local_files reads them)


def _load_local(spec: str, key: str, cfg: DataConfig, group: Optional[str] = None) -> Table:
    """Read one local file or class folder into a :class:`Table` with standard columns (and ``group``'s, for
    the carve)."""
    table = read_local(spec, key, cfg)
    if table.files is not None:
        if group is not None:
            raise ConfigError(f"data.validation_split_by: {spec} is a folder of class sub-folders, which has no "
                              f"column {group!r}; row or text")
        return table  # the folder layout: its columns are standard already
    beside = (cfg.train_file or cfg.dataset_name) if key in ("data.validation_file", "data.test_file") else None
    if key == "data.train_file":
        warn_of_a_split_column(table, [cfg.text_column, cfg.text_pair_column, *label_columns(cfg.label_column), group])
    return standardize(table, cfg.text_column, cfg.text_pair_column, cfg.label_column, group, beside)


def group_column(cfg: DataConfig) -> Optional[str]:
    """The column ``data.validation_split_by`` names, or ``None`` for ``row`` and ``text``, and where nothing is
    carved (a validation file given, or no fraction and no folds)."""
    carves = cfg.validation_file is None and _carves(cfg)
    return None if cfg.validation_split_by in ("row", "text") or not carves else cfg.validation_split_by


def _carves(cfg: DataConfig) -> bool:
    """Whether validation rows are held out of the training data where it comes without a validation set."""
    return cfg.validation_folds is not None or cfg.validation_split > 0


def _carve(encoded: datasets.Dataset, read: Table, cfg: DataConfig, seed: int, label_space: LabelSpace
           ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The training rows and the validation rows held out of them: a fold of ``data.validation_folds``, else
    ``data.validation_split``'s fraction (:mod:`finetune.carve`)."""
    if cfg.validation_folds is not None:
        return carve_fold(encoded, read, cfg.validation_folds, cfg.validation_fold, seed, label_space,
                          by=cfg.validation_split_by)
    train, validation, held_out = carve_validation(encoded, read, cfg.validation_split, seed, label_space,
                                                   by=cfg.validation_split_by)
    # written back, as the run's other decisions are: config.yaml, the start line and the model card then say the
    # share held out (raised where the fraction asked for held fewer rows than the classes), and carve it again
    cfg.validation_split = held_out
    return train, validation


def _load_local_train(cfg: DataConfig) -> tuple[Table, Optional[Table]]:
    """The training file; or, from the splits a ``DatasetDict`` saved to a folder, or those of a file's
    ``data.split_column``, the training split and, as from a Hub data set, the validation split."""
    saved = read_saved_splits(cfg.train_file, "data.train_file", cfg.format)
    if saved is not None:
        return _train_and_validation(_tables_of(saved, cfg.train_file), cfg.train_file, cfg)
    if cfg.split_column is None:
        return _load_local(cfg.train_file, "data.train_file", cfg, group_column(cfg)), None
    splits = _file_splits(cfg)
    train, validation = _train_and_validation(splits, _split_column_of(cfg), cfg)
    used = {cfg.train_split}
    if validation is not None:
        used.add(cfg.validation_split_name)
    if cfg.test_file is None and cfg.test_split_name is not None:
        used.add(cfg.test_split_name)
    say_splits_left_out(splits, used, cfg.split_column)
    return train, validation


def _file_splits(cfg: DataConfig) -> dict[str, Table]:
    """The training file's rows by the split ``data.split_column`` names."""
    table = read_local(cfg.train_file, "data.train_file", cfg)
    if table.files is not None:
        raise ConfigError(f"data.split_column: {cfg.train_file} is a folder of class sub-folders, which has no "
                          f"columns")
    return rows_by_split(table, cfg.split_column)


def _split_column_of(cfg: DataConfig) -> str:
    """The training file's split column, as messages name it."""
    return f"{cfg.train_file}'s column {cfg.split_column!r}"


# --------------------------------------------------------------------------- Hub data sets


def _load_hub(cfg: DataConfig) -> tuple[Table, Optional[Table]]:
    loaded, shown = _hub_splits(cfg)
    return _train_and_validation(_tables_of(loaded, shown), shown, cfg)


def _tables_of(loaded: datasets.DatasetDict, shown: str) -> dict[str, Table]:
    """A data set's splits as tables, each named ``glue/sst2[train]`` and counted in rows."""
    return {split: Table.whole(ds, f"{shown}[{split}]", unit="row") for split, ds in loaded.items()}


def _hub_splits(cfg: DataConfig) -> tuple[datasets.DatasetDict, str]:
    """The Hub data set's splits, and its name as the messages show it (``glue/sst2``)."""
    from finetune import hub

    name = cfg.dataset_name
    shown = name + (f"/{cfg.dataset_config}" if cfg.dataset_config else "")
    offline = hub.unreachable(name, "dataset")
    try:
        with hub.datasets_cache_only(shown, offline):
            loaded = datasets.load_dataset(name, cfg.dataset_config)
    except Exception as exc:  # noqa: BLE001 - network, missing data set, bad config name, ...
        if offline is None:
            why = root_message(exc)
        elif isinstance(exc, ConnectionError):  # read from the cache alone, datasets' way of saying "not cached"
            why = f"not in datasets' local cache, and the Hub cannot be reached ({offline})"
        else:
            why = f"the Hub cannot be reached ({offline}), and the local cache did not serve it: {root_message(exc)}"
        raise DataError(f"data.dataset_name: cannot load {shown!r}: {why}",
                        hint=None if offline is None else "give the data as a file instead (--data)") from None
    return loaded, shown


def _train_and_validation(loaded: dict[str, Table], shown: str, cfg: DataConfig) -> tuple[Table, Optional[Table]]:
    """A data set's training split and, where it has one, its validation split (else ``None``: one is carved)."""
    if cfg.train_split not in loaded:
        raise DataError(f"data.train_split: {shown} has no split {cfg.train_split!r} (splits: {', '.join(loaded)})")

    def table(split: str) -> Table:
        if len(loaded[split].ds) == 0:
            raise DataError(f"{shown}[{split}]: no rows")
        return standardize(loaded[split], cfg.text_column, cfg.text_pair_column, cfg.label_column,
                           group_column(cfg) if split == cfg.train_split else None)

    train = table(cfg.train_split)
    validation = None
    if cfg.validation_file is None and cfg.validation_split_name:
        if cfg.validation_split_name in loaded:
            validation = table(cfg.validation_split_name)
        else:
            logger.info(
                "%s has no split %r; carving validation from %r", shown, cfg.validation_split_name, cfg.train_split
            )
            # written back, as the run's other decisions are: config.yaml and the model card then say
            # that the validation rows were held out of the training split
            cfg.validation_split_name = None
    return train, validation


# --------------------------------------------------------------------------- columns, texts, labels


def _check_column_settings(cfg: DataConfig) -> None:
    columns = [("data.text_column", cfg.text_column)]
    if cfg.text_pair_column is not None:
        columns.append(("data.text_pair_column", cfg.text_pair_column))
    columns += [("data.label_column", column) for column in label_columns(cfg.label_column)]
    if cfg.split_column is not None:
        columns.append(("data.split_column", cfg.split_column))
    seen: dict[str, str] = {}
    for key, column in columns:
        if column in seen:
            raise ConfigError(f"{key}: names the same column as {seen[column]} ({column!r})")
        seen[column] = key
    group = group_column(cfg)
    if group in seen:  # the texts have a setting of their own; by the labels, no class could be on both sides
        raise ConfigError(f"data.validation_split_by: names the column of {seen[group]} ({group!r})",
                          hint="data.validation_split_by=text keeps every copy of a text on one side"
                          if seen[group] != "data.label_column" else None)


def class_counts(train: datasets.Dataset, num_labels: int) -> np.ndarray:
    """Training samples per class id (single labels)."""
    return np.bincount(np.asarray(read_column(train, LABELS), dtype=np.int64), minlength=num_labels)


# from this share of scored rows trained on, their scores are more memory than generalisation
SEEN_IN_TRAINING_AT_MOST = 0.2


def text_rows(split: datasets.Dataset) -> list[tuple]:
    """Each row's input: its text, with its pair where the split has pairs. Two rows with the same one are
    the same text to the model, whatever their labels."""
    columns = [name for name in (TEXT, TEXT_PAIR) if name in split.column_names]
    return list(zip(*(read_column(split, name) for name in columns)))


def rows_seen_in(train: datasets.Dataset, split: datasets.Dataset) -> int:
    """How many rows of ``split`` have a text (with its pair) that a row of ``train`` has too."""
    trained = set(text_rows(train))
    return sum(row in trained for row in text_rows(split))


def content_sha256(ds: datasets.Dataset) -> str:
    """SHA-256 of a split's rows (values and schema, in its order): what a resume compares, so that a file
    edited in place is not taken for the same data."""
    import hashlib

    digest = hashlib.sha256()
    digest_rows(digest, ds)
    return digest.hexdigest()


def digest_rows(digest, ds: datasets.Dataset) -> None:
    """Feed a split's row count and rows to a ``hashlib`` digest: the Arrow IPC bytes of each batch
    (values, nulls and the schema: features, label names), in the split's current order."""
    digest.update(str(len(ds)).encode())
    for batch in ds.with_format("arrow").iter(batch_size=10_000):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_table(batch)
        digest.update(sink.getvalue())
