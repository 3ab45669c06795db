"""The validation rows carved out of the training data (``data.validation_split``), and the ``max_*_samples``
caps.

A carve draws ``data.validation_split`` of the training rows, seeded, stratified by class for single labels, by
label for several (:func:`iterative_stratification`) and by the target's order for a number per text
(:func:`target_strata`).
Collected data repeats itself, though (the SMS Spam Collection holds 328 repeats among its 4862 messages): a
carve of rows puts copies of one text on both sides, and those validation rows score what the model remembers.
``data.validation_split_by: text`` carves texts instead: every copy of a text (with its pair) falls on the same
side, so no validation text is a training text, and the fraction is one of the distinct texts.

``data.validation_folds: K`` deals the same units (rows or distinct texts) into K folds instead, and holds out
fold ``data.validation_fold``: the K runs of a config validate on every unit once, each unit in one fold.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Hashable, Iterable, Optional

import datasets
import numpy as np

from finetune.column_hints import another_label_column
from finetune.columns import read_column
from finetune.errors import DataError
from finetune.labels import LabelSpace
from finetune.tables import GROUP, LABELS, TEXT, TEXT_PAIR, Table

logger = logging.getLogger(__name__)


def _units(by: str) -> str:
    """What a carve draws, as its messages name it."""
    return {"row": "rows", "text": "distinct texts"}.get(by, f"distinct values of column {by!r}")


def _unit(by: str) -> str:
    return {"row": "row", "text": "distinct text"}.get(by, f"value of column {by!r}")


def carve_validation(train: datasets.Dataset, read: Table, fraction: float, seed: int, label_space: LabelSpace,
                     by: str = "row") -> tuple[datasets.Dataset, datasets.Dataset, float]:
    """Split ``fraction`` of ``train`` (encoded from the table ``read``) off as validation, seeded; stratified by
    class for single_label, by label for multi_label. ``by``: ``row`` draws rows, ``text`` draws distinct texts with
    all their rows.

    Returns the training rows, the validation rows and the fraction held out: ``fraction``, unless one unit of
    each class was more (a larger fraction that carves the same units again, :func:`fraction_of`)."""
    groups, firsts = _units_of(train, read, by)
    if label_space.problem_type == "regression":
        n_validation = _validation_units(len(firsts), read.source, fraction, by)
        chosen = target_strata(_unit_targets(train, firsts), n_validation, seed)
        return *_rows_of_units(train, groups, chosen), fraction
    if label_space.problem_type == "multi_label":
        n_validation = _validation_units(len(firsts), read.source, fraction, by)
        side = iterative_stratification(_unit_label_sets(train, firsts), [len(firsts) - n_validation, n_validation],
                                        seed)
        return *_rows_of_units(train, groups, np.flatnonzero(side == 1)), fraction
    return _carve_stratified(train, groups, firsts, read, fraction, seed, label_space, by)


def fraction_of(n_validation: int, units: int) -> float:
    """The largest fraction whose carve of ``units`` rounds up to no more than ``n_validation`` units (so that,
    with at least one unit of each class, it carves ``n_validation`` again): ``n_validation / units``, stepped
    below where the float product rounds up past it (``7 / 25 * 25`` is ``7.000000000000001``)."""
    share = n_validation / units
    while math.ceil(share * units) > n_validation:
        share = math.nextafter(share, 0.0)
    return share


def carve_fold(train: datasets.Dataset, read: Table, folds: int, fold: int, seed: int, label_space: LabelSpace,
               by: str = "row") -> tuple[datasets.Dataset, datasets.Dataset]:
    """Fold ``fold`` (1 to ``folds``) of ``train`` as validation, the other folds as training.

    The units (rows, or distinct texts with all their rows: ``by``) are shuffled with ``seed`` and dealt round
    the folds in turn, for single_label class by class: each fold then holds each class's share to within one
    unit, and the folds' sizes differ by one at most; for multi_label by :func:`iterative_stratification`, each
    fold holding about its share of each label; for regression in the targets' order, each run of ``folds``
    units one to each fold (:func:`target_folds`). The same seed deals the same folds in every run, so the
    ``folds`` runs of a config hold out every unit once.
    """
    groups, firsts = _units_of(train, read, by)
    units = len(firsts)
    if units < folds:
        raise DataError(f"{read.source}: {units} {_units(by)} are too few for {folds} folds "
                        "(data.validation_folds)")
    if label_space.problem_type == "multi_label":  # each label's share in each fold, as near as the sets allow
        fold_of = iterative_stratification(_unit_label_sets(train, firsts), [units / folds] * folds, seed)
    elif label_space.problem_type == "regression":
        fold_of = target_folds(_unit_targets(train, firsts), folds, seed)
    else:
        _, unit_labels = _unit_labels(train, firsts, read, label_space, by,
                                      f"dealing {folds} folds by class (data.validation_folds)",
                                      "Add rows, or leave the class out")
        fold_of = class_folds(unit_labels, folds, seed)
    return _rows_of_units(train, groups, np.flatnonzero(fold_of == fold - 1))


def class_folds(unit_labels: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Each unit's fold (0 to ``folds - 1``) for single labels: the units shuffled (seeded), sorted by class with
    the shuffle kept within each, and dealt round the folds in turn."""
    order = np.random.default_rng(seed).permutation(len(unit_labels))
    order = order[np.argsort(unit_labels[order], kind="stable")]
    fold_of = np.empty(len(unit_labels), dtype=np.int64)
    fold_of[order] = np.arange(len(unit_labels)) % folds
    return fold_of


def _units_of(train: datasets.Dataset, read: Table, by: str) -> tuple[np.ndarray, np.ndarray]:
    """Each row's unit (:func:`unit_groups`), and each unit's first row, in unit order."""
    groups = unit_groups(train, read, by)
    return groups, np.unique(groups, return_index=True)[1]


def _unit_labels(train: datasets.Dataset, firsts: np.ndarray, read: Table, label_space: LabelSpace, by: str,
                 draw: str, remedy: str) -> tuple[np.ndarray, np.ndarray]:
    """Each row's class and each unit's (a text whose copies disagree: its first row's), after refusing a column
    that holds no classes and a class with one unit, which a ``draw`` by class cannot put on both sides."""
    labels = np.asarray(read_column(train, LABELS), dtype=np.int64)
    not_labels = not_a_label_column(np.bincount(labels, minlength=len(label_space)), read)
    if not_labels is not None:
        raise not_labels
    unit_labels = labels[firsts]
    counts = np.bincount(unit_labels, minlength=len(label_space))
    too_few = [label_space.names[i] for i in np.flatnonzero(counts == 1)]
    if too_few:
        raise DataError(f"{read.source}: class {too_few[0]!r} has only 1 {_unit(by)}; {draw} needs at least 2 per class. "
                        f"{remedy}")
    return labels, unit_labels


def _validation_units(units: int, source: str, fraction: float, by: str) -> int:
    """The units a carve without classes holds out (rounded up, as datasets does), refusing a carve that would
    leave none to train on."""
    n_validation = math.ceil(fraction * units)
    if units - n_validation < 1:
        raise DataError(f"{source}: {units} {_units(by)} are too few to carve a validation set "
                        f"(data.validation_split: {fraction}); give data.validation_file")
    return n_validation


def _unit_label_sets(train: datasets.Dataset, firsts: np.ndarray) -> np.ndarray:
    """multi_label: each unit's labels (its first row's), a ``units x labels`` bool array, read from the Arrow
    column's values as they lie: as Python lists, a million rows of a thousand labels would be a billion floats."""
    values = train.with_format("arrow")[LABELS].combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return values.reshape(len(train), -1)[firsts] > 0


def iterative_stratification(label_sets: np.ndarray, sizes: list[float], seed: int) -> np.ndarray:
    """Each unit's subset (an index of ``sizes``), so that each subset holds about its share of every label.

    Sechidis, Tsoumakas and Vlahavas's iterative stratification ("On the stratification of multi-label data",
    2011): the label with the fewest units left goes first, each of its units (in a seeded random order) to the
    subset that most lacks that label, then the one that most lacks units, then a seeded draw; again until no
    labelled unit is left; the units without a label fill what each subset lacks. A rare label is so spread
    before the common ones fill the subsets, where a random draw can leave it out of a small validation set.
    ``sizes``: each subset's wanted number of units (their sum, the units). By hand: scikit-learn stratifies by
    one label only, and scikit-multilearn, which has this, would bring SciPy's sparse matrices for forty lines.
    """
    rng = np.random.default_rng(seed)
    units = label_sets.shape[0]
    order = rng.permutation(units)
    lacking = np.asarray(sizes, dtype=np.float64)  # units each subset still lacks
    per_label = label_sets.sum(0)
    lacking_label = np.outer(lacking / max(units, 1), per_label)  # subsets x labels
    left = per_label.astype(np.int64)
    subset = np.full(units, -1, dtype=np.int64)
    while left.any():
        label = int(np.argmin(np.where(left > 0, left, np.iinfo(np.int64).max)))
        for unit in order[label_sets[order, label]]:
            if subset[unit] >= 0:
                continue
            j = _most_lacking(lacking_label[:, label], lacking, rng)
            labels = label_sets[unit]
            subset[unit] = j
            lacking[j] -= 1
            lacking_label[j, labels] -= 1
            left[labels] -= 1
    for unit in order[subset[order] < 0]:
        subset[unit] = j = _most_lacking(lacking, lacking, rng)
        lacking[j] -= 1
    return subset


def _most_lacking(first: np.ndarray, then: np.ndarray, rng: np.random.Generator) -> int:
    """The subset with the largest ``first``, of those the largest ``then``, of those a seeded draw."""
    tied = np.flatnonzero(first == first.max())
    if tied.size > 1:
        tied = tied[then[tied] == then[tied].max()]
    return int(tied[0] if tied.size == 1 else rng.choice(tied))


def _unit_targets(train: datasets.Dataset, firsts: np.ndarray) -> np.ndarray:
    """regression: each unit's target (its first row's)."""
    return np.asarray(read_column(train, LABELS), dtype=np.float64)[firsts]


def _in_target_order(targets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The units from the lowest target to the highest, equal targets in a seeded random order."""
    shuffled = rng.permutation(len(targets))
    return shuffled[np.argsort(targets[shuffled], kind="stable")]


def target_strata(targets: np.ndarray, n_validation: int, seed: int) -> np.ndarray:
    """The ``n_validation`` units a regression carve holds out: the units in their targets' order cut into
    ``n_validation`` runs as equal as they go, and one unit drawn (seeded) from each.

    The held-out targets then spread as the whole's do, quantile by quantile (the ``i``-th lowest held-out target
    lies between the whole's ``i/n`` and ``(i+1)/n`` quantiles), where a random draw of a hundred units leaves a
    tail short or over-full by chance. By hand: scikit-learn's and datasets' splits stratify by a class only.
    """
    rng = np.random.default_rng(seed)
    order = _in_target_order(targets, rng)
    bounds = np.arange(n_validation + 1) * len(targets) // n_validation
    starts, widths = bounds[:-1], np.diff(bounds)
    return order[starts + (rng.random(n_validation) * widths).astype(np.int64)]


def target_folds(targets: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Each unit's fold (0 to ``folds - 1``) for a regression model: the units in their targets' order, each run
    of ``folds`` of them dealt one to each fold in a seeded order (the last, shorter run to as many folds). Every
    fold so spans the targets' range as the whole does, and the folds' sizes differ by one at most."""
    rng = np.random.default_rng(seed)
    order = _in_target_order(targets, rng)
    runs = -(-len(targets) // folds)
    # a permutation of the folds for each run; the last run's units take the first of its own
    dealt = np.argsort(rng.random((runs, folds)), axis=1).ravel()[:len(targets)]
    fold_of = np.empty(len(targets), dtype=np.int64)
    fold_of[order] = dealt
    return fold_of


def _carve_stratified(train: datasets.Dataset, groups: np.ndarray, firsts: np.ndarray, read: Table,
                      fraction: float, seed: int, label_space: LabelSpace, by: str
                      ) -> tuple[datasets.Dataset, datasets.Dataset, float]:
    """One class per text: each class keeps its share on both sides, and each class has a unit on each (the
    fraction held out raised for it where ``fraction`` of the units are fewer than the classes)."""
    labels, unit_labels = _unit_labels(train, firsts, read, label_space, by,
                                       f"carving a stratified validation set (data.validation_split: {fraction})",
                                       "Add rows, or give data.validation_file")
    counts = np.bincount(unit_labels, minlength=len(label_space))
    present, units = int((counts > 0).sum()), len(firsts)
    # Rounded up like datasets does, and at least one per class so stratification can work.
    n_validation = max(math.ceil(fraction * units), present)
    if units - n_validation < present:
        raise DataError(
            f"{read.source}: {units} {_units(by)} are too few to carve a validation set with all {present} "
            f"classes on both sides (data.validation_split: {fraction}); give data.validation_file"
        )
    held_out = fraction
    if n_validation > math.ceil(fraction * units):
        held_out = fraction_of(n_validation, units)
        logger.warning("%s: data.validation_split: %g of its %d %s is too few to hold one of each of its %d "
                       "classes: %d held out instead (%.0f%%), as config.yaml records; data.validation_file keeps "
                       "them all for training", read.source, fraction, units, _units(by), present, n_validation,
                       100 * held_out)
    if by == "row":
        return *stratified_split(train, labels, n_validation, seed), held_out
    # the units drawn as rows are: one row per unit (a distinct text, a column's value), its class the rows'
    # ClassLabel
    one_per_unit = datasets.Dataset.from_dict(
        {"unit": np.arange(units), LABELS: unit_labels},
        features=datasets.Features({"unit": datasets.Value("int64"), LABELS: train.features[LABELS]}))
    _, validation_units = stratified_split(one_per_unit, unit_labels, n_validation, seed)
    return *_rows_of_units(train, groups, np.asarray(read_column(validation_units, "unit"), dtype=np.int64)), held_out


def unit_groups(train: datasets.Dataset, read: Table, by: str) -> np.ndarray:
    """Each row's unit, numbered in order of first appearance: its own row, its text's, or its value's in the
    column ``by`` names (a row without one is refused: which rows it goes with is unknown)."""
    if by == "row":
        return np.arange(len(train))
    if by == "text":
        return text_groups(train)
    values = read_column(train, GROUP)
    missing = [i for i, value in enumerate(values) if value is None]
    if missing:
        raise DataError(f"{read.source}: {read.where(missing[0])} has no value in column {by!r} "
                        "(data.validation_split_by), which says the rows that go together")
    return _numbered(value if isinstance(value, (str, int, float, bool)) else
                     json.dumps(value, sort_keys=True, default=str) for value in values)


def text_groups(train: datasets.Dataset) -> np.ndarray:
    """For each row, the number of its text (with its pair) among the distinct texts, in order of first
    appearance: rows with one number are copies of one text."""
    columns = [read_column(train, name) for name in (TEXT, TEXT_PAIR) if name in train.column_names]
    return _numbered(zip(*columns))


def _numbered(keys: Iterable[Hashable]) -> np.ndarray:
    """Each key's number among the distinct keys, in order of first appearance."""
    numbers: dict[Hashable, int] = {}
    return np.fromiter((numbers.setdefault(key, len(numbers)) for key in keys), dtype=np.int64)


def _rows_of_units(train: datasets.Dataset, groups: np.ndarray, validation_units: np.ndarray
                   ) -> tuple[datasets.Dataset, datasets.Dataset]:
    held_out = np.isin(groups, validation_units)
    return train.select(np.flatnonzero(~held_out)), train.select(np.flatnonzero(held_out))


def not_a_label_column(counts: np.ndarray, read: Table) -> Optional[DataError]:
    """The error for single labels (``counts``: rows per class) most of which, of ten or more, are on one row
    each: names, titles, ids or the texts themselves (columns swapped), not classes; None for a label column."""
    present = int((counts > 0).sum())
    single = int((counts == 1).sum())
    if not single * 2 > present >= 10:
        return None
    return DataError(
        f"{read.source}: column {read.label_column!r} (data.label_column) holds {present} different labels, "
        f"{single} of them on one row only: a label column names a few classes, each on many rows",
        hint=another_label_column(read) or "name the column of the labels: --label COLUMN (data.label_column=COLUMN)")


def stratified_split(train: datasets.Dataset, labels: np.ndarray, n_validation: int,
                     seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``train.train_test_split(test_size=n_validation, stratify_by_column=LABELS, seed=seed)``: the same rows.

    datasets reads the label column for it one formatted row at a time (12 s for 300,000 rows); its own
    stratified draw, given the labels read at once, takes a tenth of a second. Where that function has moved,
    datasets' method gives the same split, slowly.
    """
    try:
        from datasets.utils.stratify import stratified_shuffle_split_generate_indices
    except ImportError:
        parts = train.train_test_split(test_size=n_validation, stratify_by_column=LABELS, seed=seed)
        return parts["train"], parts["test"]
    n_train = len(train) - n_validation
    train_rows, validation_rows = next(stratified_shuffle_split_generate_indices(
        labels, n_train, n_validation, rng=np.random.default_rng(seed)))
    return train.select(train_rows), train.select(validation_rows)


def subset(ds: datasets.Dataset, limit: Optional[int], seed: int) -> datasets.Dataset:
    """At most ``limit`` rows drawn with ``seed``, kept in the split's order."""
    if limit is None or limit >= len(ds):
        return ds
    rows = np.sort(np.random.default_rng(seed).choice(len(ds), size=limit, replace=False))
    return ds.select(rows)
