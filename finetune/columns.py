"""A whole column of a ``datasets.Dataset``, read at once, and one to add."""

from __future__ import annotations

from typing import Any


def read_column(ds, name: str) -> list[Any]:
    """Column ``name`` of ``ds`` (its selected rows, in their order) as a list, in one read of its Arrow array.

    ``ds[name]`` holds the same values, but datasets 4 and later make it a lazy column that formats one row
    at a time when it is iterated: seconds per hundred thousand rows, and minutes where ``torch.as_tensor``
    or NumPy convert it index by index. This read takes milliseconds.

    A split that selects or orders rows (a carved validation set, a shuffled split) maps its rows through an
    index table, datasets' private ``_indices``. Its public read gathers such a column one row at a time, into
    an Arrow chunk per row, whatever the column holds (1.6 s of a run's start on 300,000 texts: bench/README.md,
    start-up); where the mapping is there to read, one Arrow ``take`` does it, to the same values. Without it,
    the public read.
    """
    return arrow_column(ds, name).to_pylist()


def arrow_column(ds, name: str) -> "pa.ChunkedArray | pa.Array":  # noqa: F821
    """Column ``name`` of ``ds`` (its selected rows, in their order) as Arrow holds it, read as
    :func:`read_column` reads it: for NumPy to count over without a Python object per value."""
    if not hasattr(ds, "_indices") or not (ds._indices is None or _is_index_table(ds._indices)):
        return ds.with_format("arrow")[name]
    column = ds.data.column(name)
    return column if ds._indices is None else column.take(ds._indices.column(0))


def _is_index_table(mapping: Any) -> bool:
    """Whether datasets' row mapping is what it has been: a table of one column of row numbers."""
    import pyarrow as pa

    return getattr(mapping, "num_columns", None) == 1 and pa.types.is_integer(mapping.column(0).type)


def list_column(rows: "np.ndarray") -> "pa.ListArray":  # noqa: F821
    """The rows of a 2-D array as an Arrow column of a list per row, what ``Dataset.add_column`` takes for a
    ``Sequence`` feature.

    ``add_column`` fingerprints its arguments by pickling them, a Python object at a time: 300,000 rows' label
    lists took 2.3 s of a multi-label run's start (bench/README.md, start-up), an Arrow column milliseconds. The
    column's values and type (``list<float>``) are those of ``rows.tolist()``, as is the split's digest.
    """
    import numpy as np
    import pyarrow as pa

    width = rows.shape[1]
    offsets = np.arange(len(rows) + 1, dtype=np.int32) * width
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(rows.reshape(-1)))
