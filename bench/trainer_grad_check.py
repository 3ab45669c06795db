"""Does ``transformers.Trainer`` apply BERT's gradient unchanged when it accumulates (k > 1)?

The Trainer passes ``num_items_in_batch`` to any model whose ``forward``
accepts ``**kwargs`` and then skips its own division of the loss by ``k``,
trusting the model to have divided by the window's item count.
``BertForSequenceClassification.forward`` accepts ``**kwargs`` but computes a
plain per-micro-batch mean, so the applied gradient could come out ``k`` times
too large. This script measures it with the real embedded MiniLM: one update
on the same 32 SMS samples at ``(b=32, k=1)`` and ``(b=8, k=4)``, dropout off,
no clipping, gradients captured just before the optimizer step, compared with
the mean per-sample gradient computed directly.

Run: ``python bench/trainer_grad_check.py [--out FILE]``; the benchmark runs it
first and records the finding.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import ArmSpec, job_config, load_job  # noqa: E402

SAMPLES = 32


def _flat_grad(model):
    import torch

    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters() if p.grad is not None])


def trainer_gradient(model, dataset, collator, b: int, k: int, accepts_loss_kwargs=None):
    """The gradient the Trainer hands to the optimizer for its first update."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    captured = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            captured["grad"] = _flat_grad(model).clone()

    model = copy.deepcopy(model)
    if accepts_loss_kwargs is not None:
        model.accepts_loss_kwargs = accepts_loss_kwargs
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=b, gradient_accumulation_steps=k, max_steps=1,
            learning_rate=1e-5, max_grad_norm=0.0, report_to="none", save_strategy="no", disable_tqdm=True,
            use_cpu=True, seed=0, dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                          callbacks=[Capture()])
        flag = trainer.model_accepts_loss_kwargs
        trainer.train()
    return captured["grad"], flag


def check() -> dict:
    """Compare the Trainer's applied gradient with the true mean gradient; returns the finding."""
    import torch.nn.functional as F
    from transformers import DataCollatorWithPadding

    spec = ArmSpec("trainer", "sms", b=SAMPLES, k=1)
    cfg = job_config(spec, ["model.dropout=0.0"])
    tokenizer, tokenized, _, model, _ = load_job(cfg)
    data = tokenized["train"].select(range(SAMPLES)).remove_columns(["length"])
    collator = DataCollatorWithPadding(tokenizer)

    reference = copy.deepcopy(model).train()
    batch = collator([data[i] for i in range(SAMPLES)])
    labels = batch.pop("labels")
    F.cross_entropy(reference(**batch).logits, labels).backward()
    true_grad = _flat_grad(reference)

    rows = {}
    for name, b, k, flag in (("k1", SAMPLES, 1, None), ("k4", SAMPLES // 4, 4, None),
                             ("k4_accepts_loss_kwargs_false", SAMPLES // 4, 4, False)):
        grad, accepts = trainer_gradient(model, data, collator, b, k, accepts_loss_kwargs=flag)
        rows[name] = {
            "b": b,
            "k": k,
            "model_accepts_loss_kwargs": accepts,
            "grad_norm_ratio": float(grad.norm() / true_grad.norm()),
            "cosine": float(F.cosine_similarity(grad, true_grad, dim=0)),
            "max_rel_diff": float((grad - true_grad).abs().max() / true_grad.abs().max()),
        }
    ratio = rows["k4"]["grad_norm_ratio"]
    changes = abs(ratio - 1.0) > 1e-3
    summary = (
        f"Trainer at k=4 applies {ratio:.3f}x the true mean gradient to BERT (k=1: "
        f"{rows['k1']['grad_norm_ratio']:.3f}x): model_accepts_loss_kwargs={rows['k4']['model_accepts_loss_kwargs']}, "
        "so it passes num_items_in_batch to a forward that ignores it and skips its own division by k"
        if changes else
        f"Trainer at k=4 applies the true mean gradient to BERT (ratio {ratio:.4f})"
    )
    return {"changes_gradients": changes, "summary": summary, "runs": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the finding as JSON here")
    args = parser.parse_args(argv)
    finding = check()
    text = json.dumps(finding, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
