"""An encoder layer's attention, forward and backward, under each of torch's attention kernels.

::

    python -m bench.attention [--model PATH] [--batch 64] [--length 128] [--micro-batches 4] [--rounds 5] [--json F]

Of the 65.8 ms of kernels an update of bert-base's compiled blocks took on an
H100 at ``(64, 4)`` and 128 tokens, attention took 5.9 ms (the third lease's
``host`` part): about 95 TFLOP/s by the benchmark's count, where the
update's matrix products ran several times faster. Inside the package's CUDA
graphs the model keeps its attention mask (a host read to drop an all-ones
mask cannot be captured), and ``scaled_dot_product_attention`` with a mask
and dropout cannot take the flash kernel, so torch picks among the others.
This probe times one layer's attention at the job's shapes, forward and
backward, under each kernel torch has (``SDPBackend``), asked for alone:

- with the mask transformers builds for a padded micro-batch (a boolean
  ``(b, 1, L, L)`` expanded from the padding), and without a mask;
- with the model's dropout (``--dropout``, BERT's 0.1) and without it.

Each row gives milliseconds (median of ``--rounds`` rounds, the kernels
alternating), TFLOP/s (the benchmark's count, 12 x hidden x length squared
per text and layer), an update's sum (layers x micro-batches), and, without
dropout, the largest relative difference of the output and of the query's
gradient from the math kernel's in fp32. A kernel that refuses the shapes,
the dtype, the mask or the dropout is named, with the reason torch gives.
In bf16 on a GPU and fp32 on a CPU, where the test suite checks the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.products import median_milliseconds, model_sizes, probe_arguments  # noqa: E402

KERNELS = {"torch's choice": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
CASES = (("mask", True), ("no mask", False))


def attention_inputs(batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Query, key, value and the output's gradient, made once; the mask of a micro-batch whose last text has a
    quarter of padding, as transformers expands it for SDPA (``True`` where a token may attend)."""
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    q, k, v = (rand(batch, heads, length, head_dim).requires_grad_() for _ in range(3))
    keep = torch.ones(batch, length, dtype=torch.bool, device=device)
    keep[-1, length - length // 4:] = False
    mask = keep[:, None, None, :].expand(batch, 1, length, length)
    return {"q": q, "k": k, "v": v, "grad": rand(batch, heads, length, head_dim), "mask": mask}


def only(kernel: SDPBackend | None):
    """The context that leaves torch ``kernel`` alone to choose, or its own choice where None: what the model
    gets."""
    return sdpa_kernel([kernel]) if kernel is not None else contextlib.nullcontext()


def attention_step(inputs: dict, kernel: SDPBackend | None, masked: bool,
                   dropout: float) -> Callable[[], torch.Tensor]:
    """One forward and backward of the attention under ``kernel`` alone; returns the output."""
    def step():
        for name in ("q", "k", "v"):
            inputs[name].grad = None
        with only(kernel):
            out = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], dropout_p=dropout,
                                                 attn_mask=inputs["mask"] if masked else None)
        out.backward(inputs["grad"])
        return out
    return step


def refusal(step: Callable[[], torch.Tensor]) -> str | None:
    """Why torch will not run ``step``'s kernel, or None: the first sentence of its error, the warnings that say
    why folded in."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step()
        except RuntimeError as error:  # "No available kernel"; its reasons come as warnings
            said = " ".join(str(w.message) for w in caught)
            reasons = " ".join(re.sub(r"\(Triggered internally at [^)]*\)", "", said).split())
            return str(error).split(". ")[0] + (f": {reasons}" if reasons else "")
    return None


def difference_from_math(inputs: dict, kernel: SDPBackend | None, masked: bool) -> dict[str, float]:
    """Without dropout: the largest difference of ``kernel``'s output and query gradient from the math kernel's
    in fp32, each relative to the latter's largest value."""
    def run(chosen, dtype):
        leaves = {name: inputs[name].detach().to(dtype).requires_grad_() for name in ("q", "k", "v")}
        with only(chosen):
            out = F.scaled_dot_product_attention(leaves["q"], leaves["k"], leaves["v"],
                                                 attn_mask=inputs["mask"] if masked else None)
        out.backward(inputs["grad"].to(dtype))
        return out.float(), leaves["q"].grad.float()

    (out, grad_q), (exact_out, exact_grad_q) = run(kernel, inputs["q"].dtype), run(SDPBackend.MATH, torch.float32)
    return {"output": ((out - exact_out).abs().max() / exact_out.abs().max()).item(),
            "grad query": ((grad_q - exact_grad_q).abs().max() / exact_grad_q.abs().max()).item()}


def measure(inputs: dict, dropouts: tuple[float, ...], rounds: int, repeats: int, device: torch.device) -> dict:
    """Every case and kernel: milliseconds (median of ``rounds``, kernels alternating) where the kernel runs,
    the reason where it refuses."""
    rows, refused = [], {}
    for case, masked in CASES:
        for dropout in dropouts:
            steps = {}
            for name, kernel in KERNELS.items():
                step = attention_step(inputs, kernel, masked, dropout)
                why = refusal(step)
                if why is None:
                    steps[name] = step
                else:
                    refused[f"{name}, {case}, dropout {dropout}"] = why
            for name, ms in median_milliseconds(steps, rounds, repeats, device).items():
                row = {"case": case, "dropout": dropout, "kernel": name, "ms": ms}
                if dropout == 0:
                    row["difference"] = difference_from_math(inputs, KERNELS[name], masked)
                rows.append(row)
    return {"rows": rows, "refused": refused}


def report(result: dict, setting: str, flop: float, per_update: int) -> str:
    """Markdown: the kernels' times for each case, then the refusals."""
    lines = [f"**An encoder layer's attention, forward and backward, under each kernel** ({setting})", "",
             "| case | dropout | kernel | ms | TFLOP/s | an update, ms | output vs fp32 math | grad query vs fp32 math |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        difference = row.get("difference")
        cells = [f"{difference['output']:.1e}", f"{difference['grad query']:.1e}"] if difference else ["", ""]
        lines.append(f"| {row['case']} | {row['dropout']} | {row['kernel']} | {row['ms']:.4f} | "
                     f"{flop / row['ms'] / 1e9:.1f} | {row['ms'] * per_update:.2f} | " + " | ".join(cells) + " |")
    if result["refused"]:
        lines += ["", "Refused:", ""] + [f"- {name}: {why}" for name, why in result["refused"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probe_arguments(parser, repeats=20)
    parser.add_argument("--heads", type=int, help="attention heads, over the model's (bert-base's 12 without)")
    parser.add_argument("--dropout", type=float, default=0.1, help="the attention's dropout, beside none")
    args = parser.parse_args(argv)

    hidden, _, layers = model_sizes(args.model)
    heads = args.heads or (json.loads((Path(args.model) / "config.json").read_text())["num_attention_heads"]
                           if args.model else 12)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = attention_inputs(args.batch, heads, args.length, hidden // heads, dtype, device)
    result = measure(inputs, (args.dropout, 0.0) if args.dropout else (0.0,), args.rounds, args.repeats, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    setting = (f"{name}, {str(dtype).removeprefix('torch.')}, {args.batch} x {args.length} tokens, {heads} heads "
               f"of {hidden // heads}, {layers} layers, {args.micro_batches} micro-batches an update, "
               f"{args.rounds} rounds of {args.repeats} calls")
    flop = 12 * args.batch * hidden * args.length ** 2
    print(report(result, setting, flop, layers * args.micro_batches))
    if args.json:
        args.json.write_text(json.dumps({"setting": setting, "flop": flop, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
