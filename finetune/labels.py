"""The label column into label ids: a class per row, a set of classes per row, or a number to predict.

The label space comes from the training split (:func:`encode_train`): the names of ``data.label_map`` in its
order where it is set, a ``ClassLabel``'s names in order, else the distinct labels sorted (integers numerically),
less ``data.drop_labels``; in the order of the trained head a run starts from where it was trained for these
labels (``_for_head``). Every other split is encoded against it (:func:`encode_against`), where a label the
training data never had is an error naming its row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import datasets
import numpy as np

from finetune.columns import list_column
from finetune.errors import ConfigError, DataError
from finetune.label_columns import per_label_hint
from finetune.label_warnings import (in_another_case, same_but_for_case, warn_of_a_head_for_other_labels,
                                     warn_of_joined_labels, warn_of_labels_differing_in_case)
from finetune.tables import LABELS, RAW_LABEL, SHOW_LABELS, Table, column_values, short_list

logger = logging.getLogger(__name__)

# the hint of an error that names rows without a label
DROP_UNLABELLED = ("data.on_missing_label=drop leaves those rows out (a file labelled in part trains on its labelled "
                   "rows)")


@dataclass
class LabelSpace:
    """The labels of a data set, in label-id order, and what kind of labels they are.

    Args:
        names: Label names (as strings); position ``i`` is label id ``i``. For
            regression, one name: the target's (the label column's).
        problem_type: single_label, multi_label or regression (see :mod:`finetune.tasks`).
        origin: Whose labels they are, as errors name them: the training data's, or ``finetune score``'s model's.
    """

    names: list[str]
    problem_type: str = "single_label"
    origin: str = "the train data"

    @property
    def label2id(self) -> dict[str, int]:
        """Class name -> class id."""
        return {name: i for i, name in enumerate(self.names)}

    @property
    def id2label(self) -> dict[int, str]:
        """Class id -> class name (what ``PretrainedConfig.id2label`` expects)."""
        return dict(enumerate(self.names))

    def __len__(self) -> int:
        return len(self.names)

    def lacking(self, label: str, said: str) -> DataError:
        """The error for ``label``, not one of these, where ``said`` names it with its file and row."""
        hint = same_but_for_case(label, self.names, self.origin)
        return DataError(f"{said} not among the {len(self)} labels of {self.origin} "
                         f"({short_list(self.names, SHOW_LABELS)})", hint=hint)


def encode_train(train: Table, problem_type: str, delimiter: Optional[str], label_map: Optional[dict[str, str]] = None,
                 dropped: Optional[list[str]] = None, head: Optional[list[str]] = None
                 ) -> tuple[datasets.Dataset, LabelSpace]:
    """The training split with its labels as ids, and the label space found in it (``label_map``: the names
    ``data.label_map`` gives the file's labels, whose order is then the ids; ``dropped``: ``data.drop_labels``;
    ``head``: the classes of the trained head the run starts from, whose order the ids take where they are these)."""
    if problem_type == "single_label":
        keys = _named(train, _label_keys(train), label_map)
        label_space = _for_head(_label_space(train, keys, label_map), head)
        return _encode_labels(train, keys, label_space), label_space
    if problem_type == "multi_label":
        found = _label_sets(train, delimiter)
        if dropped:
            _refuse_labels_not_found(train, dropped, {key for keys in found for key in keys})
        sets = _named_sets(train, _without(train, found, dropped), label_map)
        label_space = _for_head(_multi_label_space(train, sets, label_map), head)
        return _encode_label_sets(train, sets, label_space), label_space
    return _encode_targets(train), LabelSpace([train.label_column], "regression")


def _for_head(label_space: LabelSpace, head: Optional[list[str]]) -> LabelSpace:
    """The data's labels in the order of the trained ``head`` the run starts from, where it was trained for them
    (case aside), so that each output keeps its class; else as they are, with a warning where its are others."""
    named = {name.casefold(): name for name in label_space.names}
    if head is not None and len(named) == len(label_space) and sorted(n.casefold() for n in head) == sorted(named):
        return dataclasses.replace(label_space, names=[named[n.casefold()] for n in head])
    warn_of_a_head_for_other_labels(head, label_space.names)
    return label_space


def encode_against(table: Table, label_space: LabelSpace, delimiter: Optional[str],
                   label_map: Optional[dict[str, str]] = None, dropped: Optional[list[str]] = None
                   ) -> datasets.Dataset:
    """Another split (or a file to score) with its labels as ids of ``label_space``."""
    if label_space.problem_type == "multi_label":
        sets = _without(table, _label_sets(table, delimiter), dropped)
        return _encode_label_sets(table, _named_sets(table, sets, label_map), label_space)
    if label_space.problem_type == "regression":
        return _encode_targets(table)
    return _encode_labels(table, _named(table, _label_keys(table), label_map), label_space)


def leave_out_labels(table: Table, dropped: Optional[list[str]], problem_type: str, training: bool) -> Table:
    """single_label: ``table`` without its rows labelled one of ``dropped`` (``data.drop_labels``), said in one
    line; one the training data (``training``) lacks is an error. multi_label's are taken out as sets are read."""
    if not dropped or problem_type != "single_label":
        return table
    keys = _label_keys(table)
    if training:
        _refuse_labels_not_found(table, dropped, set(keys))
    left_out = np.isin(np.asarray(keys, dtype=object), dropped)
    if not left_out.any():
        return table
    if left_out.all():
        raise DataError(f"{table.source}: every row is labelled one of data.drop_labels ({', '.join(dropped)})")
    logger.info("%s: left out %d of %d %ss, labelled %s (data.drop_labels)", table.source, left_out.sum(),
                len(keys), table.unit, " or ".join(sorted({k for k, out in zip(keys, left_out) if out})))
    return table.keep(np.flatnonzero(~left_out))


def leave_out_unlabelled(table: Table, policy: str, problem_type: str, delimiter: Optional[str]) -> Table:
    """``data.on_missing_label: drop``: ``table`` without its rows that have no label (null, an empty field, NaN,
    a Hub data set's ``-1``), said in one line; ``error`` leaves them to the encoders, whose errors name them. A
    multi-label row's empty list, or empty field with ``data.label_delimiter``, is a text with no label: it stays."""
    if policy != "drop" or (problem_type == "multi_label" and table.empty_field_is_null and delimiter is not None):
        return table  # there an empty field reads as null, and is a text with no label
    feature = table.ds.features[RAW_LABEL]
    missing = np.array([_no_label(value, feature, problem_type) for value in column_values(table.ds, RAW_LABEL)],
                       dtype=bool)
    if not missing.any():
        return table
    if missing.all():
        raise DataError(f"{table.source}: column {table.label_column!r} has no labels in any of its {len(missing)} "
                        f"rows (unlabelled data?)")
    logger.warning("%s: left out %d of %d %ss without a label (%s; data.on_missing_label)", table.source,
                   missing.sum(), len(missing), table.unit, table.where_many(np.flatnonzero(missing)))
    return table.keep(np.flatnonzero(~missing))


def _no_label(value: Any, feature: Any, problem_type: str) -> bool:
    """Whether a raw label is missing as the encoder of ``problem_type`` reads it (one it refuses: its error's)."""
    if isinstance(feature, datasets.ClassLabel) and isinstance(value, int):
        return value < 0  # a Hub data set's "no label"
    if problem_type == "multi_label":  # an empty list or field is a text with no label, not a missing one
        return value is None or (isinstance(value, float) and math.isnan(value))
    try:
        return (_target(value) if problem_type == "regression" else _label_key(value, feature)) is None
    except ValueError:
        return False


def _refuse_labels_not_found(train: Table, dropped: list[str], found: set[str]) -> None:
    """A label of ``data.drop_labels`` the training data does not have: a typo, most often, that left nothing out.
    One its ``ClassLabel`` declares is among them though no row holds it (a 0/1 column of 0s alone)."""
    feature = train.ds.features[RAW_LABEL]
    found = found | set(getattr(getattr(feature, "feature", feature), "names", ()))
    missing = [label for label in dropped if label not in found]
    if not missing:
        return
    names = sorted(found)
    cased = next(((label, name) for label in missing if (name := in_another_case(label, names)) is not None), None)
    raise ConfigError(f"data.drop_labels: {', '.join(map(repr, missing))} not among the labels of {train.source} "
                      f"({short_list(names, SHOW_LABELS)})",
                      hint=f"the training data writes {cased[0]!r} as {cased[1]!r}: labels are told apart by case"
                      if cased else None)


def _without(table: Table, sets: list[list[str]], dropped: Optional[list[str]]) -> list[list[str]]:
    """multi_label: each row's set without the labels of ``data.drop_labels``, said in one line."""
    if not dropped:
        return sets
    kept = [[key for key in keys if key not in dropped] for keys in sets]
    changed = sum(len(a) != len(b) for a, b in zip(sets, kept))
    if changed:
        logger.info("%s: took %s out of the labels of %d of %d %ss (data.drop_labels)", table.source,
                    " and ".join(dropped), changed, len(sets), table.unit)
    return kept


def _named(table: Table, keys: list[str], label_map: Optional[dict[str, str]]) -> list[str]:
    """Each label as ``data.label_map`` names it; one that is a name of the map already stays (a file written
    with the names, such as predictions scored). A label the map does not know is an error naming its row."""
    if label_map is None:
        return keys
    names = set(label_map.values())
    for i, key in enumerate(keys):
        if key not in label_map and key not in names:
            raise DataError(f"{table.source}: label {key!r} at {table.where(i)} in column {table.label_column!r} "
                            f"is not in data.label_map ({short_list(list(label_map), SHOW_LABELS)})")
    return [label_map.get(key, key) for key in keys]


def _named_sets(table: Table, sets: list[list[str]], label_map: Optional[dict[str, str]]) -> list[list[str]]:
    """multi_label: :func:`_named` for each row's set of labels."""
    if label_map is None:
        return sets
    flat = [key for keys in sets for key in keys]
    rows = [i for i, keys in enumerate(sets) for _ in keys]  # each label's row, for the error's "line N"
    named = _named(dataclasses.replace(table, positions=table.positions[rows]), flat, label_map)
    named_sets, start = [], 0
    for keys in sets:
        named_sets.append(sorted(set(named[start:start + len(keys)])))
        start += len(keys)
    return named_sets


def _label_keys(table: Table) -> list[str]:
    """Each row's label as a class name; DataError on missing or unusable labels."""
    feature = table.ds.features[RAW_LABEL]
    values = column_values(table.ds, RAW_LABEL)
    _refuse_mixed_label_types(table, values)
    keys: list[Optional[str]] = []
    for i, value in enumerate(values):
        try:
            keys.append(_label_key(value, feature))
        except ValueError as exc:
            raise DataError(
                f"{table.source}: label {value!r} at {table.where(i)} in column {table.label_column!r} {exc}",
                hint=_problem_type_hint(value),
            ) from None
    missing = [i for i, key in enumerate(keys) if key is None]
    if len(missing) == len(keys):
        raise DataError(f"{table.source}: column {table.label_column!r} has no labels in any of its {len(keys)} rows "
                        "(unlabelled data?)")
    if missing:
        raise DataError(
            f"{table.source}: {len(missing)} row{'s' if len(missing) > 1 else ''} without a label in column "
            f"{table.label_column!r} ({table.where_many(missing)})", hint=DROP_UNLABELLED
        )
    return keys  # type: ignore[return-value]  # no None left


def _refuse_mixed_label_types(table: Table, values: list[Any]) -> None:
    """A typed file (JSON) whose labels are numbers in some rows and strings in others is refused.

    ``0`` and ``"ham"`` in one column are two ways of writing labels, most
    likely from two sources joined: read as they are, they would be four
    classes where there are two.
    """
    numbers = [i for i, v in enumerate(values) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    strings = [i for i, v in enumerate(values) if isinstance(v, str)]
    if numbers and strings:
        raise DataError(
            f"{table.source}: column {table.label_column!r} holds numbers ({table.where_many(numbers)}) and "
            f"strings ({table.where_many(strings)}); write every label the same way"
        )


def _label_key(value: Any, feature: Any) -> Optional[str]:
    """A label value as its class name; None for a missing label.

    Raises:
        ValueError: with the reason, for values that cannot be a class.
    """
    if value is None:
        return None
    if isinstance(feature, datasets.ClassLabel):
        return feature.int2str(value) if value >= 0 else None  # -1 is "no label" in Hub data sets
    if isinstance(value, int):  # a bool too: "True"
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if value.is_integer():  # integer labels read as floats, e.g. next to an empty field
            return str(int(value))
        raise ValueError("is not a class (labels must be strings or integers)")
    if isinstance(value, str):
        # spaces around a label are how it was typed, not a class of its own ("spam " is "spam"), as
        # around each of a multi-label field's labels
        return value.strip() or None
    raise ValueError(f"is a {type(value).__name__}, not a class (labels must be strings or integers)")


def _problem_type_hint(value: Any) -> Optional[str]:
    """The ``model.problem_type`` whose labels look like ``value``, a label a class cannot be."""
    if isinstance(value, (list, tuple)):
        return "several labels per text: set model.problem_type=multi_label"
    if isinstance(value, float):
        return "a number to predict: set model.problem_type=regression"
    return None


def _label_space(train: Table, keys: list[str], label_map: Optional[dict[str, str]] = None) -> LabelSpace:
    feature = train.ds.features[RAW_LABEL]
    present = set(keys)
    if len(present) < 2:
        raise DataError(
            f"{train.source}: the train data has only one class ({next(iter(present))!r}); "
            "a classifier needs at least two"
        )
    warn_of_labels_differing_in_case(train, keys)
    warn_of_joined_labels(train, present)
    if label_map is not None:
        return LabelSpace(names=list(dict.fromkeys(label_map.values())))  # the map's order, as a ClassLabel's
    if isinstance(feature, datasets.ClassLabel):
        return LabelSpace(names=list(feature.names))

    def order(name: str) -> tuple[int, Any]:
        try:
            return (0, int(name))
        except ValueError:
            return (1, name)

    # Integers sort numerically ("2" before "10") only when every label is one.
    numeric = all(order(name)[0] == 0 for name in present)
    return LabelSpace(names=sorted(present, key=int) if numeric else sorted(present))


def _encode_labels(table: Table, keys: list[str], label_space: LabelSpace) -> datasets.Dataset:
    """Replace the raw label column by class ids (a ClassLabel feature named ``labels``)."""
    label2id = label_space.label2id
    unseen = [i for i, key in enumerate(keys) if key not in label2id]
    if unseen:
        first = keys[unseen[0]]
        others = len({keys[i] for i in unseen}) - 1
        also = f" and {others} other unseen label{'s' if others > 1 else ''}" if others else ""
        raise label_space.lacking(first, f"{table.source}: label {first!r} at {table.where(unseen[0])}{also}")
    ids = np.asarray([label2id[key] for key in keys], dtype=np.int64)  # an array: finetune.columns.list_column says why
    ds = table.ds.remove_columns(RAW_LABEL)
    return ds.add_column(LABELS, ids, feature=datasets.ClassLabel(names=label_space.names))


def _label_sets(table: Table, delimiter: Optional[str]) -> list[list[str]]:
    """multi_label: each row's labels as class names, from a list or a delimited string.

    An empty list (or string) is a text with no label, which multi-label data may hold; a missing value is an
    error, as for single labels. A CSV or TSV field cannot tell the two apart: there, with a delimiter, an empty
    field is the empty string, and the run logs how many texts have no label.
    """
    inner = getattr(table.ds.features[RAW_LABEL], "feature", None)
    values = column_values(table.ds, RAW_LABEL)
    if table.empty_field_is_null and delimiter is not None:
        values = ["" if value is None else value for value in values]
    sets: list[list[str]] = []
    missing: list[int] = []
    for i, value in enumerate(values):
        if value is None:
            missing.append(i)
            sets.append([])
            continue
        if isinstance(value, str):
            if delimiter is None:
                raise DataError(
                    f"{table.source}: label {value!r} at {table.where(i)} in column {table.label_column!r} is a "
                    f"string; for multi_label set data.label_delimiter to split it (e.g. ','), or give lists"
                )
            value = [part.strip() for part in value.split(delimiter)]
            value = [part for part in value if part]
        elif delimiter is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # a delimited column whose every field held one integer label reads as numbers
        elif not isinstance(value, list):
            raise DataError(f"{table.source}: label {value!r} at {table.where(i)} in column "
                            f"{table.label_column!r} is not a list of labels (multi_label)", hint=per_label_hint(table))
        try:
            keys = [_label_key(v, inner) for v in value]
        except ValueError as exc:
            raise DataError(f"{table.source}: label {value!r} at {table.where(i)} in column "
                            f"{table.label_column!r}: an item {exc}") from None
        if any(k is None for k in keys):
            raise DataError(f"{table.source}: an empty label in {value!r} at {table.where(i)} "
                            f"(column {table.label_column!r})")
        sets.append(sorted(set(keys)))  # type: ignore[arg-type]
    if missing:
        raise DataError(
            f"{table.source}: {len(missing)} row{'s' if len(missing) > 1 else ''} without labels in column "
            f"{table.label_column!r} ({table.where_many(missing)}); a text with none has " + (
                "0 in each" if isinstance(table.label_column, list) else "an empty field when data.label_delimiter "
                "is set" if table.empty_field_is_null else "an empty list"), hint=DROP_UNLABELLED
        )
    unlabelled = [i for i, keys in enumerate(sets) if not keys]
    if unlabelled:
        logger.info("%s: %d of %d texts have no label (%s)", table.source, len(unlabelled), len(sets),
                    table.where_many(unlabelled))
    return sets


def _multi_label_space(train: Table, sets: list[list[str]], label_map: Optional[dict[str, str]] = None
                       ) -> LabelSpace:
    present = {key for keys in sets for key in keys}
    if len(present) < 2:
        raise DataError(f"{train.source}: the train data uses {len(present)} label"
                        f"{'' if len(present) == 1 else 's'} in column {train.label_column!r}; "
                        "multi_label needs at least two")
    warn_of_labels_differing_in_case(train, [key for keys in sets for key in keys])
    if label_map is not None:
        return LabelSpace(list(dict.fromkeys(label_map.values())), "multi_label")
    inner = getattr(train.ds.features[RAW_LABEL], "feature", None)  # a ClassLabel: a Hub set's, or a column each
    # the ClassLabel's order; else integers numerically ("2" before "10"), then names
    names = [n for n in inner.names if n in present] if isinstance(inner, datasets.ClassLabel) else (
        sorted(present, key=lambda n: (0, int(n), "") if n.lstrip("-").isdigit() else (1, 0, n)))
    return LabelSpace(names, "multi_label")


def _encode_label_sets(table: Table, sets: list[list[str]], label_space: LabelSpace) -> datasets.Dataset:
    """Replace the raw label column by 0/1 float vectors over ``label_space`` (named ``labels``)."""
    label2id = label_space.label2id
    vectors = np.zeros((len(sets), len(label_space)), dtype=np.float32)
    for i, keys in enumerate(sets):
        unseen = [k for k in keys if k not in label2id]
        if unseen:
            raise label_space.lacking(unseen[0], f"{table.source}: label {unseen[0]!r} at {table.where(i)}")
        vectors[i, [label2id[k] for k in keys]] = 1.0
    ds = table.ds.remove_columns(RAW_LABEL)
    return ds.add_column(LABELS, list_column(vectors), feature=datasets.Sequence(datasets.Value("float32")))


def _encode_targets(table: Table) -> datasets.Dataset:
    """regression: the label column as float targets (named ``labels``); one line for a row that is no number."""
    values = column_values(table.ds, RAW_LABEL)
    targets: list[float] = []
    missing: list[int] = []
    for i, value in enumerate(values):
        try:
            number = _target(value)
        except ValueError:
            raise DataError(f"{table.source}: label {value!r} at {table.where(i)} in column "
                            f"{table.label_column!r} is not a number (regression)") from None
        if number is None:
            missing.append(i)
        elif math.isinf(number):
            raise DataError(f"{table.source}: label {value!r} at {table.where(i)} is infinite")
        targets.append(number if number is not None else 0.0)
    if missing:
        raise DataError(
            f"{table.source}: {len(missing)} row{'s' if len(missing) > 1 else ''} without a number in column "
            f"{table.label_column!r} ({table.where_many(missing)})", hint=DROP_UNLABELLED
        )
    ds = table.ds.remove_columns(RAW_LABEL)
    return ds.add_column(LABELS, np.asarray(targets, dtype=np.float64), feature=datasets.Value("float32"))  # an array


def _target(value: Any) -> Optional[float]:
    """A regression label as a number; None for a missing one (null, an empty field, NaN, ``"nan"``); ValueError for
    a value that is no number (a word, a boolean, a list)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a number")
    number = float(value)  # a string that is no number raises ValueError
    return None if math.isnan(number) else number
