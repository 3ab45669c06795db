"""An encoder layer's matrix products, each timed alone: does a linear layer's bias cost its product speed?

::

    python -m bench.products [--model PATH] [--batch 64] [--length 128] [--micro-batches 4] [--rounds 5] [--json F]

Inductor's max-autotune timed bert-base's products at 8,192 tokens (one
micro-batch of 64 texts of 128 tokens) on an H100: cuBLAS's ``addmm``, the
product with its bias that ``nn.Linear`` runs, took 0.052 ms for 8192 x 768 x
768, where a plain ``mm`` of the same size in the backward took 0.020
(bench/README.md, the H100's fourth lease). If that holds outside the
autotuner, the forward's products run at about half the backward's rate, and
adding the bias apart is the lever an update's kernels need toward 40% MFU.
This probe times each product of one encoder layer in these ways:

- ``linear``: ``F.linear(x, w, b)``, what the model runs;
- ``mm, then bias``: ``F.linear(x, w)``, and the bias added by a kernel of its
  own (which a compiled block would fuse into the element-wise kernel after it);
- ``mm``: the product alone, the floor of both;
- the backward's two products, which take no bias: ``grad input``
  (``dy @ w``) and ``grad weight`` (``dy.T @ x``).

One more row times query, key and value as one product of three times the
width (the fused projection NVIDIA's and MosaicBERT's BERTs run): a wider
product keeps more of the GPU busy, and the row says whether that is worth
changing the model's attention for.

A second table times what an accumulated update does with each weight
gradient. Under bf16 autocast autograd computes a micro-batch's weight
gradient in bf16 (rounded once more), casts it to fp32 and adds it to the
parameter's fp32 gradient: three kernels, 808 additions an update of
bert-base at ``k = 4``, 3.0 ms of its 65.8 ms of kernels (the H100's third
lease). Megatron-LM's gradient accumulation fusion and Transformer Engine's
``fuse_wgrad_accumulation`` instead let the product add into the fp32
gradient in its epilogue, which torch offers as ``addmm`` with
``out_dtype=torch.float32``. The ways, per micro-batch:

- ``product, cast, added``: ``acc += (dy.T @ x).float()``, what autograd does;
- ``fp32 product, added``: the product written in fp32 (``mm`` with
  ``out_dtype``), then added: no bf16 rounding, one kernel fewer;
- ``accumulated by the product``: ``addmm(acc, dy.T, x, out_dtype=float32,
  out=acc)``, one kernel. A torch whose ``addmm`` refuses an fp32 ``acc`` with
  bf16 factors says so in the row.

Beside the times, each way's error over ``--micro-batches`` micro-batches,
against the sum made in fp64 (the norm of the difference over the sum's),
and the big batch's: one product over all the window's rows, what
``(b*k, 1)`` computes. On a CPU everything is fp32 and the ways differ in
kernels only.

In bf16 on a GPU and fp32 on a CPU (where the test suite checks the report),
the ways alternating over ``--rounds`` rounds of ``--repeats`` calls each,
every input made once, so each way reads the same memory. The report gives
each product's milliseconds (median of the rounds) and TFLOP/s, the largest
difference of ``mm, then bias`` from ``linear``'s output, and the sums an
update makes: ``layers x micro-batches`` times a layer's products, the
forward by each way and the backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FORWARD_WAYS = ("linear", "mm, then bias", "mm")
BACKWARD_WAYS = ("grad input", "grad weight")
ACCUMULATION_WAYS = ("product, cast, added", "fp32 product, added", "accumulated by the product")
BIG_BATCH = "the big batch (one product)"


@dataclass(frozen=True)
class Product:
    """One of a layer's linear maps: ``count`` of them per layer, from ``fan_in`` features to ``fan_out``."""

    name: str
    fan_in: int
    fan_out: int
    count: int
    replaces: str | None = None  # a fused product, timed as the alternative to the products of this name


FUSED_QKV = "query, key, value as one"


def layer_products(hidden: int, intermediate: int) -> list[Product]:
    """A BERT layer's linear maps: query, key and value, the attention's output, the feed-forward's two; then the
    alternative of query, key and value as one product."""
    return [Product("query, key, value", hidden, hidden, 3), Product("attention output", hidden, hidden, 1),
            Product("feed-forward in", hidden, intermediate, 1), Product("feed-forward out", intermediate, hidden, 1),
            Product(FUSED_QKV, hidden, 3 * hidden, 1, replaces="query, key, value")]


def milliseconds_per_call(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The mean time of ``repeats`` calls after one untimed call; on CUDA by events around the launches."""
    call()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - began) * 1000 / repeats


def median_milliseconds(calls: dict[str, Callable[[], object]], rounds: int, repeats: int,
                        device: torch.device) -> dict[str, float]:
    """Each call's milliseconds, the median of ``rounds`` rounds in which the calls alternate, the first of them
    rotating from round to round."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds if names else 0):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            times[name].append(milliseconds_per_call(calls[name], repeats, device))
    return {name: statistics.median(values) for name, values in times.items()}


def product_ways(product: Product, tokens: int, dtype: torch.dtype, device: torch.device) -> dict[str, Callable]:
    """Each way of computing ``product`` over ``tokens`` rows, on inputs made once."""
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype) * shape[-1] ** -0.5

    x, w, b = rand(tokens, product.fan_in), rand(product.fan_out, product.fan_in), rand(product.fan_out)
    dy = rand(tokens, product.fan_out)
    return {"linear": lambda: F.linear(x, w, b),
            "mm, then bias": lambda: F.linear(x, w) + b,
            "mm": lambda: F.linear(x, w),
            "grad input": lambda: dy @ w,
            "grad weight": lambda: dy.t() @ x}


def accumulation_ways(dtype: torch.dtype, device: torch.device) -> dict[str, Callable]:
    """Each way of adding one micro-batch's weight gradient ``dy.T @ x`` into the fp32 gradient ``acc``. In fp32
    (a CPU) the products are fp32 already: the ways keep their kernels, not their roundings."""
    low = dtype != torch.float32

    def cast_and_add(acc, dy, x):
        acc.add_((dy.t() @ x).float())

    def fp32_product(acc, dy, x):
        acc.add_(torch.mm(dy.t(), x, out_dtype=torch.float32) if low else dy.t() @ x)

    def by_the_product(acc, dy, x):
        if low:
            torch.addmm(acc, dy.t(), x, out_dtype=torch.float32, out=acc)
        else:
            acc.addmm_(dy.t(), x)

    return dict(zip(ACCUMULATION_WAYS, (cast_and_add, fp32_product, by_the_product)))


def refusals(ways: dict[str, Callable], dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """The ways this torch refuses (``addmm``'s fp32 ``acc`` with low-precision factors is recent, and a CPU has
    no ``out_dtype`` products), each with its error's first sentence."""
    acc, small = torch.zeros(8, 8, device=device), torch.ones(16, 8, device=device, dtype=dtype)
    refused = {}
    for name, way in ways.items():
        try:
            way(acc, small, small)
        except (RuntimeError, TypeError) as error:  # a missing kernel: NotImplementedError, a RuntimeError
            refused[name] = str(error).split(". ")[0] or type(error).__name__  # the dispatcher's first sentence
    return refused


def accumulation_errors(product: Product, tokens: int, micro_batches: int, ways: dict[str, Callable],
                        dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """Each way's weight gradient summed over ``micro_batches`` micro-batches, and the big batch's one product,
    against the sum made in fp64: the norm of the difference over the sum's."""
    generator = torch.Generator(device=device).manual_seed(1)
    shape = (product.fan_out, product.fan_in)
    sums = {name: torch.zeros(shape, device=device) for name in ways}
    exact = torch.zeros(shape, device=device, dtype=torch.float64)
    dys, xs = [], []
    for _ in range(micro_batches):
        dy = torch.randn(tokens, product.fan_out, generator=generator, device=device).to(dtype)
        x = torch.randn(tokens, product.fan_in, generator=generator, device=device).to(dtype)
        exact += dy.double().t() @ x.double()
        for name, way in ways.items():
            way(sums[name], dy, x)
        dys.append(dy)
        xs.append(x)
    sums[BIG_BATCH] = (torch.cat(dys).t() @ torch.cat(xs)).float()
    return {name: ((total.double() - exact).norm() / exact.norm()).item() for name, total in sums.items()}


def measure_accumulation(products: list[Product], tokens: int, micro_batches: int, rounds: int, repeats: int,
                         dtype: torch.dtype, device: torch.device) -> dict:
    """Each product's weight gradient added into fp32 by each way this torch takes: milliseconds per micro-batch
    (median of ``rounds``, ways alternating), and each way's error over an update's micro-batches."""
    ways = accumulation_ways(dtype, device)
    refused = refusals(ways, dtype, device)
    ways = {name: way for name, way in ways.items() if name not in refused}
    rows = []
    for product in products:
        if product.replaces is not None:  # a fused product's gradient is its parts' side by side
            continue
        generator = torch.Generator(device=device).manual_seed(0)
        dy = torch.randn(tokens, product.fan_out, generator=generator, device=device).to(dtype)
        x = torch.randn(tokens, product.fan_in, generator=generator, device=device).to(dtype)
        acc = torch.zeros(product.fan_out, product.fan_in, device=device)
        calls = {name: (lambda way=way: way(acc, dy, x)) for name, way in ways.items()}
        rows.append({"product": product.name, "count": product.count, "tokens": tokens, "fan_in": product.fan_in,
                     "fan_out": product.fan_out, "flop": 2 * tokens * product.fan_in * product.fan_out,
                     "ms": median_milliseconds(calls, rounds, repeats, device),
                     "error": accumulation_errors(product, tokens, micro_batches, ways, dtype, device)})
    return {"refused": refused, "rows": rows}


def largest_difference(ways: dict[str, Callable]) -> float:
    """How far ``mm, then bias`` lands from ``linear``, relative to ``linear``'s largest output."""
    fused, apart = ways["linear"]().float(), ways["mm, then bias"]().float()
    return ((fused - apart).abs().max() / fused.abs().max()).item()


def measure(products: list[Product], tokens: int, rounds: int, repeats: int, dtype: torch.dtype,
            device: torch.device) -> list[dict]:
    """Each product's milliseconds per way (median of ``rounds``, ways alternating) and its differences."""
    rows = []
    for product in products:
        ways = product_ways(product, tokens, dtype, device)
        rows.append({"product": product.name, "count": product.count, "replaces": product.replaces, "tokens": tokens,
                     "fan_in": product.fan_in, "fan_out": product.fan_out,
                     "flop": 2 * tokens * product.fan_in * product.fan_out,
                     "ms": median_milliseconds(ways, rounds, repeats, device),
                     "relative_difference": largest_difference(ways)})
    return rows


def per_update(rows: list[dict], layers: int, micro_batches: int) -> dict[str, float]:
    """The milliseconds an update's products take: every layer's, once per micro-batch, the forward by each way
    and the backward (both of its products); then the same with each fused product in place of those it
    replaces."""
    def total(ways, chosen) -> float:
        return layers * micro_batches * sum(row["count"] * sum(row["ms"][way] for way in ways) for row in chosen)

    apart = [row for row in rows if row["replaces"] is None]
    sums = {f"forward, {way}": total([way], apart) for way in FORWARD_WAYS}
    sums["backward"] = total(BACKWARD_WAYS, apart)
    for fused in (row for row in rows if row["replaces"] is not None):
        with_fused = [row for row in apart if row["product"] != fused["replaces"]] + [fused]
        sums.update({f"forward, {way}, {fused['product']}": total([way], with_fused) for way in FORWARD_WAYS})
        sums[f"backward, {fused['product']}"] = total(BACKWARD_WAYS, with_fused)
    return sums


def accumulation_per_update(accumulation: dict, layers: int, micro_batches: int) -> dict[str, float]:
    """The milliseconds an update spends making and adding its weight gradients, by each way."""
    rows = accumulation["rows"]
    ways = rows[0]["ms"] if rows else {}
    return {f"weight gradients, {way}": layers * micro_batches * sum(row["count"] * row["ms"][way] for row in rows)
            for way in ways}


def accumulation_report(accumulation: dict, micro_batches: int) -> list[str]:
    """Markdown: the weight gradients' accumulation by each way, its times and its errors."""
    ways = list(accumulation["rows"][0]["ms"]) if accumulation["rows"] else []
    errors = ways + [BIG_BATCH]
    lines = ["", "**A weight gradient added into fp32, per micro-batch**: milliseconds (median), TFLOP/s in "
             f"brackets; then each way's relative error over {micro_batches} micro-batches against their sum in "
             "fp64", "",
             "| product (rows x in x out) | " + " | ".join(ways) + " | " + " | ".join(f"error: {e}" for e in errors)
             + " |", "| --- |" + " ---: |" * (len(ways) + len(errors))]
    for row in accumulation["rows"]:
        cells = [f"{row['ms'][way]:.4f} ({row['flop'] / row['ms'][way] / 1e9:.1f})" for way in ways]
        cells += [f"{row['error'][name]:.1e}" for name in errors]
        lines.append(f"| {row['product']} ({row['tokens']} x {row['fan_in']} x {row['fan_out']}) | "
                     + " | ".join(cells) + " |")
    for name, why in accumulation["refused"].items():
        lines += ["", f"Refused by this torch: `{name}`: {why}"]
    return lines


def report(rows: list[dict], accumulation: dict, sums: dict[str, float], setting: str, micro_batches: int) -> str:
    """Markdown: a table of the products, one of the weight gradients' accumulation, then the update's sums."""
    ways = FORWARD_WAYS + BACKWARD_WAYS
    lines = [f"**A layer's products, each alone** ({setting}): milliseconds (median), TFLOP/s in brackets", "",
             "| product (rows x in x out) | per layer | " + " | ".join(ways) + " | mm, then bias vs linear |",
             "| --- | ---: |" + " ---: |" * len(ways) + " ---: |"]
    for row in rows:
        cells = [f"{row['ms'][way]:.4f} ({row['flop'] / row['ms'][way] / 1e9:.1f})" for way in ways]
        per_layer = f"{row['count']}, for {row['replaces']}" if row["replaces"] else str(row["count"])
        lines.append(f"| {row['product']} ({row['tokens']} x {row['fan_in']} x {row['fan_out']}) | {per_layer} | "
                     + " | ".join(cells) + f" | {row['relative_difference']:.1e} |")
    lines += accumulation_report(accumulation, micro_batches)
    lines += ["", "| an update's products | ms |", "| --- | ---: |"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in sums.items()]
    return "\n".join(lines)


def model_sizes(model: str | None) -> tuple[int, int, int]:
    """The hidden and intermediate sizes and the layer count of ``model``'s config.json (bert-base's without)."""
    if model is None:
        return 768, 3072, 12
    config = json.loads((Path(model) / "config.json").read_text())
    return config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]


def probe_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """What every probe of one layer's kernels takes: the model whose sizes it uses, the micro-batch's shape, the
    micro-batches an update, the rounds and calls, and a JSON file for its rows."""
    parser.add_argument("--model", help="a model folder whose config.json gives the sizes (default: bert-base's)")
    parser.add_argument("--batch", type=int, default=64, help="texts per micro-batch")
    parser.add_argument("--length", type=int, default=128, help="tokens per text")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per update (k)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=repeats, help="calls per way and round")
    parser.add_argument("--json", type=Path, help="also write the rows here")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probe_arguments(parser, repeats=50)
    parser.add_argument("--hidden", type=int, help="the hidden size, over the model's")
    parser.add_argument("--intermediate", type=int, help="the feed-forward's size, over the model's")
    parser.add_argument("--layers", type=int, help="the layer count, over the model's")
    args = parser.parse_args(argv)

    hidden, intermediate, layers = model_sizes(args.model)
    hidden, intermediate, layers = args.hidden or hidden, args.intermediate or intermediate, args.layers or layers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.batch * args.length
    rows = measure(layer_products(hidden, intermediate), tokens, args.rounds, args.repeats, dtype, device)
    accumulation = measure_accumulation(layer_products(hidden, intermediate), tokens, args.micro_batches,
                                        args.rounds, args.repeats, dtype, device)
    sums = per_update(rows, layers, args.micro_batches) | accumulation_per_update(accumulation, layers,
                                                                                   args.micro_batches)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if os.environ.get("DISABLE_ADDMM_CUDA_LT", "0") not in ("", "0"):  # ATen reads it: addmm kept off cuBLASLt
        name += ", addmm without cuBLASLt (DISABLE_ADDMM_CUDA_LT=1)"
    setting = (f"{name}, {str(dtype).removeprefix('torch.')}, {args.batch} x {args.length} tokens a micro-batch, "
               f"{layers} layers, {args.micro_batches} micro-batches an update, {args.rounds} rounds of "
               f"{args.repeats} calls")
    print(report(rows, accumulation, sums, setting, args.micro_batches))
    if args.json:
        args.json.write_text(json.dumps({"setting": setting, "rows": rows, "accumulation": accumulation,
                                         "per_update": sums}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
