"""Run a Python script as ``__main__`` and record the process's peak memory when it ends.

``accelerate launch bench/memprobe.py finetune/train.py ARGS`` runs the
package's unchanged CLI in the launched process and writes, at exit, that
process's peak resident memory (and on a GPU ``max_memory_allocated`` and
``max_memory_reserved``, which alone counts a CUDA graph's pool) to the
JSON file named by ``BENCH_MEMORY_OUT``. The script's folder replaces this
one at the head of ``sys.path``, as if it had been launched directly.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys
from pathlib import Path


def peak_memory() -> dict:
    """Peak resident memory of this process (MiB) and, on a GPU, peak allocated and peak reserved device memory
    (MiB): a CUDA graph's memory pool counts as allocated only while it is captured, as reserved for good. Reads
    torch only where the process has imported it (the arms in ``bench/common.py`` share this)."""
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20  # ru_maxrss: KiB on Linux, bytes on macOS
    out = {"rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "gpu_peak_mib": None,
           "gpu_reserved_peak_mib": None}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu_reserved_peak_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def main() -> None:
    target = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(target).resolve().parent)
    code = 0
    try:
        runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    finally:
        Path(os.environ["BENCH_MEMORY_OUT"]).write_text(json.dumps(peak_memory()) + "\n", encoding="utf-8")
    sys.exit(code)


if __name__ == "__main__":
    main()
