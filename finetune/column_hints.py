"""What a missing or misnamed column is told: the column of a name like it, or the columns whose values look like
the ones asked for.

A missing column is first looked for by its name: the same name in another
case or with spaces around it (``Headline`` for ``headline``), or one a
letter or two away (``sentance`` for ``sentence``). Failing that, the texts
are guessed in the column of the longest strings, the labels in the column
of the fewest distinct values. Where a guessed column's name is also one of
its own values (a column named ``ham`` that holds ``ham`` and ``spam``), the
file's first line was a row read as its header, and the hint says how to
read a file without one instead.
"""

from __future__ import annotations

import difflib
import json
from typing import Optional

import datasets
import numpy as np

from finetune.tables import Table, column_values, lists_or_mappings

# the options of finetune train, score and sweep that set the columns a hint guesses
FLAGS = {"data.text_column": "--text", "data.text_pair_column": "--text-pair", "data.label_column": "--label"}
# rows of the data a guess looks at
SAMPLE = 1000


# pandas' DataFrame.to_json writes a table by columns unless told otherwise: what its layouts read as
_PANDAS_LAYOUTS = ({"columns", "index", "data"}, {"schema", "data"})
PANDAS_JSON_HINT = ("pandas' DataFrame.to_json writes columns, not rows, unless told: write it as JSON Lines, "
                    "df.to_json('data.jsonl', orient='records', lines=True), and pass that file")


def pandas_layout(ds: datasets.Dataset) -> bool:
    """Whether ``ds`` is a JSON file that pandas wrote by columns (its default ``orient``: one row of mappings
    from index to value) or as ``split`` or ``table``, rather than as rows. A mapping that holds lists or
    mappings (``{"corpus": {"data": [...]}}``) is an object nested deeper, which pandas does not write."""
    if set(ds.column_names) in _PANDAS_LAYOUTS:
        return True
    return len(ds) == 1 and all(isinstance(feature, dict) and not any(map(lists_or_mappings, feature.values()))
                                for feature in ds.features.values())


def column_hint(ds: datasets.Dataset, missing_keys: list[str], configured: dict[str, str]) -> Optional[str]:
    """The hint for ``missing_keys`` (``data.text_column``, ``data.label_column``) of ``ds``, whose columns the
    config names as ``configured`` (key -> column): the options that name the columns that look like them, or
    how to read a file whose first line is a row, or one that pandas wrote by columns."""
    if pandas_layout(ds):
        return PANDAS_JSON_HINT
    sample = _sample(ds)
    by_name, by_values = _named_and_valued(sample, missing_keys, configured)
    guesses = {key: by_name.get(key) or by_values[key] for key in missing_keys
               if key in by_name or key in by_values}
    if not guesses:
        return None
    if not by_name:
        as_row = _header_read_from_a_row(sample, guesses, configured)
        if as_row is not None:
            return as_row
    options = " ".join(f"{FLAGS[key]} {column}" for key, column in guesses.items() if key in FLAGS)
    keys = ", ".join(f"{key}={column}" for key, column in guesses.items())
    by = "by the names" if not by_values else "by the values" if not by_name else "by the names and values"
    return f"{by}, try {options} ({keys})" if options else f"{by}, try {keys}"


def rename_hint(ds: datasets.Dataset, missing_keys: list[str], configured: dict[str, str], beside: str) -> str:
    """The hint for ``missing_keys`` of a validation or test file read ``beside`` the training data: one setting
    names the columns of both, so the options :func:`column_hint` would give would lose the training data's
    columns; the columns to rename in this file instead."""
    if pandas_layout(ds):
        return PANDAS_JSON_HINT
    sample = _sample(ds)
    by_name, by_values = _named_and_valued(sample, missing_keys, configured)
    guesses = {key: by_name.get(key) or by_values[key] for key in missing_keys if key in by_name or key in by_values}
    columns = ", ".join(configured.values())
    same = f"it is read with the columns of the training data ({beside})"
    row = None if by_name else _named_as_its_values(sample, guesses)
    if row is not None:
        return f"{same}, and its first line looks like a row (column {row!r} holds {row!r} in its rows too): " \
               f"add a header line naming its columns ({columns})"
    renames = ", ".join(f"{column!r} to {configured[key]!r}" for key, column in guesses.items())
    return f"{same}: rename {renames} in it" if renames else f"{same}: name its columns {columns}"


def _named_and_valued(sample: datasets.Dataset, missing_keys: list[str], configured: dict[str, str]
                      ) -> tuple[dict[str, str], dict[str, str]]:
    """The columns guessed for ``missing_keys`` by their names, and for the rest by their values."""
    by_name = _by_name(sample.column_names, missing_keys, configured)
    by_values = _guesses(sample, [key for key in missing_keys if key not in by_name],
                         set(configured.values()) | set(by_name.values()))
    return by_name, by_values


def another_label_column(table: Table) -> Optional[str]:
    """The hint of :func:`column_hint` for a label column that is not one, from the columns the source had."""
    if table.as_read is None:  # a class folder, whose labels are its sub-folders
        return None
    configured = {"data.text_column": table.text_column, "data.text_pair_column": table.pair_column,
                  "data.label_column": table.label_column}
    hint = column_hint(table.as_read, ["data.label_column"],
                       {key: column for key, column in configured.items() if column is not None})
    if hint is not None or table.pair_column is not None:
        return hint
    sample = _sample(table.as_read)
    if _distinct_values(column_values(sample, table.text_column)) is not None:  # the texts are labels: swapped
        return (f"the two columns look swapped: --text {table.label_column} --label {table.text_column} "
                f"(data.text_column={table.label_column}, data.label_column={table.text_column})")
    return None


def _sample(ds: datasets.Dataset) -> datasets.Dataset:
    """The first rows of ``ds``, which a guess looks at."""
    return ds.select(range(min(len(ds), SAMPLE)))


def named_like(wanted: str, columns: list[str]) -> Optional[str]:
    """The column of ``columns`` that ``wanted`` likely meant: the same but for case and surrounding spaces, else
    the closest in spelling; None when none is close."""
    same = [name for name in columns if name.strip().casefold() == wanted.strip().casefold()]
    close = same or difflib.get_close_matches(wanted, columns, n=1, cutoff=0.8)
    return close[0] if close else None


def _by_name(columns: list[str], missing_keys: list[str], configured: dict[str, str]) -> dict[str, str]:
    """The column each missing key's name was likely meant for, among the columns the config does not name. A
    key whose column exists (and holds the wrong values) is left to its values."""
    guesses: dict[str, str] = {}
    for key in missing_keys:
        wanted = configured.get(key)
        if wanted is None or wanted in columns:
            continue
        unclaimed = [name for name in columns if name not in configured.values() and name not in guesses.values()]
        match = named_like(wanted, unclaimed)
        if match is not None:
            guesses[key] = match
    return guesses


def _guesses(sample: datasets.Dataset, missing_keys: list[str], named: set[str]) -> dict[str, str]:
    """The column each missing key's values look like, among the columns the config does not name."""
    free = [name for name in sample.column_names if name not in named]
    guesses = {}
    if "data.text_column" in missing_keys:
        strings = [name for name in free
                   if isinstance(sample.features[name], datasets.Value) and sample.features[name].dtype in
                   ("string", "large_string")]
        lengths = {name: np.mean([len(v or "") for v in column_values(sample, name)]) for name in strings}
        if lengths:
            guesses["data.text_column"] = max(lengths, key=lengths.get)
    if "data.label_column" in missing_keys:
        candidates = {}
        for name in free:
            if name == guesses.get("data.text_column"):
                continue
            distinct = _distinct_values(column_values(sample, name))
            if distinct is not None:
                candidates[name] = distinct
        if candidates:
            guesses["data.label_column"] = min(candidates, key=candidates.get)
    return guesses


def _distinct_values(values: list) -> Optional[int]:
    """How many different values a column that looks like labels holds: a handful, or a rare repeat; None for
    a column that does not (an id or a free text repeats nothing)."""
    try:
        distinct = len({json.dumps(v, sort_keys=True, default=str) for v in values})
    except TypeError:
        return None
    return distinct if 2 <= distinct <= max(2, len(values) // 2) else None


def _header_read_from_a_row(sample: datasets.Dataset, guesses: dict[str, str], configured: dict[str, str]
                            ) -> Optional[str]:
    """The hint for a first line that is a row: a guessed column whose name is one of its own values."""
    column = _named_as_its_values(sample, guesses)
    if column is None:
        return None
    names = {column: configured[key] for key, column in guesses.items()}
    found = set(configured.values())
    in_order = [names.get(column, column if column in found else f"column{i}")
                for i, column in enumerate(sample.column_names, start=1)]
    return (f"its first line looks like a row, not a header: column {column!r} holds {column!r} in its rows too; "
            f"a file without a header reads with data.has_header=false data.column_names=[{','.join(in_order)}]")


def _named_as_its_values(sample: datasets.Dataset, guesses: dict[str, str]) -> Optional[str]:
    """The first guessed column whose name is also one of its values (the first line was a row), or ``None``."""
    return next((column for column in guesses.values()
                 if column in {str(value) for value in column_values(sample, column)}), None)
