"""Warnings about how the training data writes its labels: labels that differ only in case, and single labels
that join several. Each names what it saw and the setting that would change it; the run goes on, since a data
set may mean them as written. Besides: a trained head the run starts from whose classes are others; the hint for
a label another split writes in another case."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

from finetune.tables import SHOW_LABELS, Table, short_list

logger = logging.getLogger(__name__)


def warn_of_labels_differing_in_case(train: Table, keys: list[str]) -> None:
    """Warn of labels of the training data that differ only in case (``spam``, ``Spam``): each is a class.

    Most often one label typed two ways, which would train as two classes
    and split its rows between them; but a data set may mean them apart, so
    the run goes on, and the warning names them with their rows.
    """
    counts = Counter(keys)
    groups: dict[str, list[str]] = {}
    for name in sorted(counts):
        groups.setdefault(name.casefold(), []).append(name)
    clashes = [names for names in groups.values() if len(names) > 1]
    if not clashes:
        return
    shown = " and ".join(f"{name!r} ({counts[name]} row{'s' if counts[name] > 1 else ''})" for name in clashes[0])
    more = f"; {len(clashes) - 1} more such group{'s' if len(clashes) > 2 else ''}" if len(clashes) > 1 else ""
    logger.warning("%s: labels %s in column %r differ only in case, and train as %d classes%s; if they are one, "
                   "write it one way in the file (or map them with data.label_map)", train.source, shown,
                   train.label_column, len(clashes[0]), more)


# what joins several labels in one field, most often
LABEL_JOINERS = ("|", ";", ",")


def warn_of_joined_labels(train: Table, classes: set[str]) -> None:
    """Warn of single labels that look like several joined (``food|music``): a class for each combination.

    Several labels per text written in one field train, as single labels, one
    class per combination seen: more classes than labels, each with fewer
    rows, and none for a combination the training data lacks. The warning
    comes where at least three classes hold one joiner, and splitting them
    leaves fewer labels than there are classes.
    """
    for joiner in LABEL_JOINERS:
        joined = sorted(name for name in classes if joiner in name)
        if len(joined) < 3:
            continue
        parts = sorted({part.strip() for name in classes for part in name.split(joiner) if part.strip()})
        if len(parts) >= len(classes):
            continue
        logger.warning("%s: %d of the %d classes in column %r join others with %r (%s): if a text has several "
                       "labels, model.problem_type=multi_label data.label_delimiter=%r trains one output for each "
                       "of the %d labels (%s)", train.source, len(joined), len(classes), train.label_column, joiner,
                       short_list(joined, 3), joiner, len(parts), short_list(parts, SHOW_LABELS))
        return


def warn_of_a_head_for_other_labels(head: Optional[list[str]], names: list[str]) -> None:
    """Warn of a trained head (:func:`finetune.modeling.trained_head_labels`) with as many outputs as the data has
    labels, trained for other classes than the data's ``names``: each output starts as the data's label in its
    place. A head of another number of outputs is an error of its own."""
    if head is None or len(head) != len(names):
        return
    taken = ", ".join(f"{trained} as {name}" for trained, name in list(zip(head, names))[:SHOW_LABELS])
    logger.warning("model.name_or_path: its head was trained for %s, not the data's labels (%s): its outputs start "
                   "as trained, each taken for the data's label in its place (%s); if they are the same classes, "
                   "data.label_map naming the data's labels as the head's keeps each output's class",
                   short_list(head, SHOW_LABELS), short_list(names, SHOW_LABELS), taken)


def same_but_for_case(label: str, names: list[str], origin: str = "the train data") -> Optional[str]:
    """The hint for a label that ``origin`` (the training data, a saved model) writes in another case (``SPAM``
    where it has ``spam``)."""
    known = in_another_case(label, names)
    if known is None:
        return None
    return (f"{origin} writes it {known!r}: labels are told apart by case; write them as {origin} does, or name "
            f"both with data.label_map")


def in_another_case(label: str, names: list[str]) -> Optional[str]:
    """The first of ``names`` that is ``label`` written in another case, if any."""
    return next((name for name in names if name.casefold() == label.casefold()), None)
