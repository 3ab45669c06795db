"""The machine's matrix-multiply peak for a precision: the denominator of model FLOPs utilisation.

Times square ``torch.matmul`` products (a few sizes, several repetitions,
median per size, best size kept) with the thread count the arms use. On a
GPU fp32 means true fp32 (TF32 stays off, PyTorch's default for matmul).

Run by ``bench/run.py``: ``python -m bench.peak PRECISION THREADS OUT_JSON``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import set_threads, write_result  # noqa: E402


def matmul_peak(precision: str, threads: int, budget_s: float = 2.0) -> dict:
    """GFLOP/s of the best square matmul size for ``precision`` (``no``: fp32, ``bf16``)."""
    import torch

    set_threads(threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    sizes = (4096, 8192) if cuda else (512, 1024, 2048)
    results = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)

        def once() -> float:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.matmul(a, b)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        first = once()  # warm-up, and the time that sizes the repetitions
        reps = max(3, min(50, int(budget_s / max(first, 1e-6))))
        times = [once() for _ in range(reps)]
        results[n] = 2 * n**3 / statistics.median(times) / 1e9
    best = max(results, key=results.get)
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads() if not cuda else None,
        "gflops_by_size": {str(n): round(v, 1) for n, v in results.items()},
        "peak_gflops": results[best],
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    write_result(argv[2], matmul_peak(argv[0], int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
