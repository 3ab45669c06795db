"""Which encoder families of transformers keep the accumulation contract: ``(8, 4)`` against ``(32, 1)``.

    python bench/families.py                       # every family below, about two minutes on 2 CPU cores
    python bench/families.py convbert big_bird     # some of them

For each family, a tiny random ``...ForSequenceClassification`` (2 blocks, width 32, dropout off) trains two
epochs of 76 texts of 9 to 24 tokens with the package's loop, once as ``(b=32, k=1)`` and once as ``(b=8, k=4)``,
from the same weights in the same sample order (the last window of each epoch ragged, the word embedding's
gradient accumulated as rows, the norm clipped at 0.5); the table gives the largest difference of any weight
after any of the six updates, and that of any weight but the attention keys' biases. A key's bias has no gradient
in exact arithmetic (softmax ignores a shift every key shares): it gets rounding noise, which AdamW's epsilon turns
into steps of about 1e-7 that differ from one batching to the other, more in the pre-LayerNorm families.
``tests/test_accumulation.py`` holds the supported families to 1e-7 (absolute) and 1e-5 (relative); a family that
keeps the contract here differs by rounding alone, one that does not by what its computation reads of the padding.
The last two columns train every family again with each micro-batch padded to one length (32 tokens), as
``data.padding: max_length`` pads it, and as ``auto`` pads the families that read the padding.
Families that a tiny config cannot build, or that this transformers release lacks, are named as such.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# the families the package supports, as the tests build them (tests/helpers.py: the family-wide tests' list and
# tiny configs, one home for both), then those measured beside them, with what their tiny configs need
sys.path.insert(0, str(REPO / "tests"))
from helpers import ARCHITECTURES as SUPPORTED  # noqa: E402
from helpers import ARCHITECTURE_SIZES  # noqa: E402
from helpers import ONE_LENGTH  # noqa: E402  (every micro-batch padded to it, as data.padding: max_length pads)
from helpers import PADDING_READERS as READERS  # noqa: E402  (data.padding: auto pads them to one length)
from helpers import pad_collate  # noqa: E402  (each micro-batch padded to its longest text, or to one length)

OTHERS = ("big_bird", "megatron-bert", "mra", "roc_bert", "xmod", "ibert", "xlm")
SIZES = {
    **ARCHITECTURE_SIZES,
    "xmod": {"languages": ["en_XX"], "default_language": "en_XX"},
    "xlm": {"emb_dim": 32, "n_layers": 2, "n_heads": 2},
}
VOCAB = 40
TEXTS, EPOCHS = 76, 2
_KEY_BIAS = re.compile(r"(key|k_proj|k_lin|\bk)\.bias$")


def tiny_model(model_type: str):
    """A 2-block random classifier of ``model_type`` with every dropout off, or the reason there is none."""
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForSequenceClassification

    from finetune.modeling import set_dropout

    if model_type not in CONFIG_MAPPING:
        return None, "not in this transformers release"
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37,
             "vocab_size": VOCAB, "max_position_embeddings": 64, "num_labels": 2}
    try:
        config = AutoConfig.for_model(model_type, **sizes, **SIZES.get(model_type, {}))
        set_dropout(config, 0.0)
        torch.manual_seed(0)
        return AutoModelForSequenceClassification.from_config(config), None
    except Exception as exc:  # a family whose config the common sizes do not fit: said, not measured
        return None, f"no tiny model: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def texts(seed: int = 1) -> list[dict]:
    """``TEXTS`` texts of 9 to 24 random tokens (ids past the special ones) with a label each."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(TEXTS):
        length = int(torch.randint(9, 25, (1,), generator=g))
        ids = [2] + torch.randint(5, VOCAB, (length - 2,), generator=g).tolist() + [3]
        rows.append({"input_ids": ids, "labels": int(torch.randint(0, 2, (1,), generator=g))})
    return rows


def train(model_type: str, b: int, k: int, width: Optional[int] = None) -> list[dict]:
    """Each update's weights of the tiny ``model_type`` trained as ``(b, k)``, each micro-batch padded to its
    longest text (or to ``width`` tokens); the model's reason where none."""
    from functools import partial

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    from finetune.config import OptimConfig
    from finetune.cpu import cpu_speedups
    from finetune.loop import TrainState, train_one_epoch
    from finetune.optimization import build_optimizer, build_scheduler, plan_updates
    from finetune.sampling import EpochSampler

    model, why = tiny_model(model_type)
    if model is None:
        raise LookupError(why)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    optim = OptimConfig(learning_rate=1e-3, warmup_steps=1, weight_decay=0.01)
    optimizer = build_optimizer(model, optim)
    loader = DataLoader(texts(), batch_size=b, sampler=EpochSampler(TEXTS, seed=7, window_size=b * k), collate_fn=partial(pad_collate, width=width))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = build_scheduler(optimizer, optim, plan_updates(len(loader), k, EPOCHS, None, warmup_steps=1))
    weights: list[dict] = []

    def keep(_state) -> bool:
        weights.append({n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()})
        return False

    state = TrainState()
    with cpu_speedups(model, optimizer, accelerator):
        for epoch in range(EPOCHS):
            train_one_epoch(model, optimizer, scheduler, loader, accelerator, epoch, state=state, max_grad_norm=0.5,
                            on_update=keep)
    return weights


def measure(model_type: str) -> dict:
    """``(8, 4)`` against ``(32, 1)`` for one family: the largest weight difference, with and without the keys'
    biases, and the weight where it is; then, with every micro-batch padded to one length, the largest but the
    keys' biases; or why it was not measured."""
    try:
        big, small = train(model_type, 32, 1), train(model_type, 8, 4)
        big_one, small_one = train(model_type, 32, 1, ONE_LENGTH), train(model_type, 8, 4, ONE_LENGTH)
    except LookupError as exc:
        return {"family": model_type, "why": str(exc)}
    gaps, others, kept = compare(big, small)
    _, others_one, kept_one = compare(big_one, small_one)
    worst = max(others, key=others.get)
    return {"family": model_type, "updates": len(big), "largest": max(gaps.values()),
            "largest_but_key_biases": others[worst], "where": worst, "keeps": kept,
            "one_length": max(others_one.values()), "keeps_one_length": kept_one}


def compare(big: list[dict], small: list[dict]) -> tuple[dict, dict, bool]:
    """Each weight's largest difference over the updates, the same without the keys' biases, and whether every
    weight but those is within the tests' tolerance after every update."""
    gaps = {name: max(float((a[name] - s[name]).abs().max()) for a, s in zip(big, small)) for name in big[0]}
    others = {name: gap for name, gap in gaps.items() if not _KEY_BIAS.search(name)}
    kept = all(bool(torch_close(a[name], s[name])) for a, s in zip(big, small) for name in others)
    return gaps, others, kept


def torch_close(a, b) -> bool:
    """Within the tolerance ``tests/test_accumulation.py`` holds the supported families to."""
    import torch

    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def table(results: list[dict]) -> str:
    lines = ["| family | supported | largest weight difference | but the keys' biases | where | within 1e-7 + 1e-5 "
             f"(keys' biases aside) | padded to {ONE_LENGTH} tokens: but the keys' biases | within |",
             "| --- | --- | ---: | ---: | --- | --- | ---: | --- |"]
    for r in results:
        supported = ("yes" if r["family"] in SUPPORTED else "no") + (" (padded to one length)" if r["family"] in READERS
                                                                     else "")
        if "why" in r:
            lines.append(f"| {r['family']} | {supported} | | | {r['why']} | | | |")
            continue
        lines.append(f"| {r['family']} | {supported} | {r['largest']:.1e} | {r['largest_but_key_biases']:.1e} | "
                     f"`{r['where']}` | {'yes' if r['keeps'] else '**no**'} | {r['one_length']:.1e} | "
                     f"{'yes' if r['keeps_one_length'] else '**no**'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"model types (default: all {len(SUPPORTED + OTHERS)})")
    args = parser.parse_args(argv)
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("finetune").setLevel(logging.ERROR)
    results = []
    for family in args.families or SUPPORTED + OTHERS:
        results.append(measure(family))
        print(f"{family}: done", file=sys.stderr, flush=True)
    print(f"transformers {transformers.__version__}, {EPOCHS} epochs of {TEXTS} texts, "
          f"{results[0].get('updates', '?')} updates\n")
    print(table(results))


if __name__ == "__main__":
    main()
