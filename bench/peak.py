"""The machine's matrix-multiply peak for a precision: the denominator of model FLOPs utilisation.

Times square ``torch.matmul`` products (a few sizes, several repetitions,
median per size, best size kept) with the thread count the arms use. On a
GPU fp32 means true fp32 (TF32 stays off, PyTorch's default for matmul).

On a GPU it first runs a few training steps of a small BERT in the run's
precision (:func:`warm_up_kernels`): the first process to use CUDA on a
fresh machine reads cuBLAS, the attention kernels and the rest of CUDA's
libraries from disk, seconds that belong to the machine and not to whichever
arm runs first. Its time is reported (``warmup_seconds``).

Run by ``bench/run.py`` before its first round: ``python -m bench.peak
PRECISION THREADS OUT_JSON``.
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


def warm_up_kernels(precision: str, device, layers: int = 2, hidden: int = 768, steps: int = 3) -> dict:
    """A few training steps of a ``layers``-deep BERT on ``device``: the kernels a run's update uses (matrix
    products, attention with a padding mask and without one, layer norm, dropout, the loss, fused AdamW), each
    launched at least once. Returns the seconds they took and how far the weights moved (more than 0: the
    steps trained)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    started = time.perf_counter()
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                        intermediate_size=4 * hidden, num_labels=2)
    model = BertForSequenceClassification(config).to(device).train()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    ids = torch.randint(1000, 2000, (8, 128), device=device)
    padded = torch.ones_like(ids)
    padded[::2, 64:] = 0
    labels = torch.randint(0, 2, (8,), device=device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16 if precision == "fp16" else None
    for step in range(steps):
        mask = padded if step % 2 == 0 else torch.ones_like(ids)  # SDPA's masked kernel, then its unmasked one
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # read on the host, so the time includes the device's work
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    return {"warmup_seconds": time.perf_counter() - started, "warmup_weight_change": moved}


def main(argv=None) -> int:
    import torch

    argv = sys.argv[1:] if argv is None else argv
    warm = {}
    if torch.cuda.is_available():
        try:
            warm = warm_up_kernels(argv[0], torch.device("cuda"))
        except Exception as error:  # the warm-up only evens out the arms' start; the peak is still wanted
            warm = {"warmup_error": f"{type(error).__name__}: {error}".splitlines()[0]}
    write_result(argv[2], {**matmul_peak(argv[0], int(argv[1])), **warm})
    return 0


if __name__ == "__main__":
    sys.exit(main())
