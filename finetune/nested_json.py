"""A JSON file of one object whose rows sit in a list under one of its keys: ``{"data": [{...}, ...]}``.

Many tools export a table this way (an API's ``results``, a labelling tool's
``data``, beside keys such as ``version``). datasets' json builder reads such
a file as one row, in whose list the table lies; :func:`rows_under_one_key`
takes the list's records out as the rows, in Arrow, with the types the
builder gave them (its JSON type for a field of mixed types included). The
builder's own ``field=`` option is not used: it reads the file again through
pandas, which turns texts of digits into numbers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import datasets
import pyarrow as pa

from finetune.errors import FileLayoutError
from finetune.text_encoding import open_bytes

logger = logging.getLogger("finetune.data")
# the first datasets release whose json builder reads one object written over several lines
MULTI_LINE_OBJECTS = "4.8.4"


def rows_under_one_key(ds: datasets.Dataset, source: str, text_column: str) -> Optional[tuple[str, datasets.Dataset]]:
    """``(key, rows)`` where ``ds``, a JSON file read by datasets, is one object that lacks ``text_column`` and
    holds the rows as a list of records under ``key``; None for any other file.

    Raises:
        FileLayoutError: where the object holds several lists of records and more than one (or none) of them has
            ``text_column``: which is the table is the user's to say.
    """
    if len(ds) != 1 or text_column in ds.column_names:
        return None
    lists = [name for name in ds.column_names if _is_list_of_records(ds.features[name])]
    if not lists:
        return None
    holding = [name for name in lists if text_column in ds.features[name].feature]
    if len(holding) != 1 and len(lists) > 1:
        raise FileLayoutError(
            f"{source}: one JSON object holding several lists of records ({', '.join(lists)}), any of which "
            f"could be the rows", hint=f"write the list to train on as JSON Lines and pass that file: python -c "
            f"\"import json; [print(json.dumps(r)) for r in json.load(open('{source}'))['{lists[0]}']]\" "
            f"> {lists[0]}.jsonl")
    key = holding[0] if holding else lists[0]
    records = ds.with_format("arrow")[key].combine_chunks().flatten()  # the one row's list: its records
    rows = datasets.Dataset(pa.Table.from_struct_array(records))
    others = [name for name in ds.column_names if name != key]
    logger.info("%s: one JSON object: its rows are the %d records under %r%s", source, len(rows), key,
                f" ({', '.join(others)} left out)" if others else "")
    return key, rows


def object_over_lines_hint(path: Path) -> Optional[str]:
    """The hint for a JSON file the json builder could not read, where an older datasets is why: before 4.8.4 it
    parsed each line of a file that is not a list on its own, so an object written over several lines
    (pretty-printed, as most tools write one) failed at its first line. None for any other file, and on newer
    releases."""
    from packaging.version import Version  # not declared: transformers, accelerate and datasets require it

    if Version(datasets.__version__) >= Version(MULTI_LINE_OBJECTS):
        return None
    with open_bytes(path) as fh:
        whole = fh.read()
    try:  # a file that is one object, on more than one line: not JSON Lines with a fault of its own
        if not isinstance(json.loads(whole), dict) or len(whole.strip().splitlines()) < 2:
            return None
    except ValueError:
        return None
    return f"datasets {MULTI_LINE_OBJECTS} or newer reads a JSON object written over several lines: " \
           f"pip install 'datasets>={MULTI_LINE_OBJECTS}', or write the file as JSON Lines"


def _is_list_of_records(feature) -> bool:
    # datasets' List of a dict of features: a list of records, as the json builder types one
    inner = getattr(feature, "feature", None)
    return isinstance(feature, (datasets.List, datasets.LargeList)) and isinstance(inner, dict)
