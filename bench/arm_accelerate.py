"""Arm (c): the same job in a minimal Accelerate loop, in the style of Accelerate's NLP example.

As in ``accelerate/examples/nlp_example.py`` (with its gradient-accumulation
variant): a shuffled ``DataLoader`` with dynamic padding, the model's own
loss, ``accelerator.backward(loss)`` inside ``accelerator.accumulate(model)``,
and ``optimizer.step()`` / ``lr_scheduler.step()`` / ``zero_grad()`` on every
batch (Accelerate skips them between synchronisations). Added only what the
job needs to be the same job: AdamW's weight-decay groups, warmup and length
of the schedule in updates, clipping at the synchronisation step. Evaluation:
``torch.no_grad`` and ``gather_for_metrics``, as in the example.

Run by ``bench/run.py``: ``python -m bench.arm_accelerate SPEC_JSON OUT_JSON``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import (  # noqa: E402
    ArmSpec,
    CountingCollator,
    job_config,
    load_job,
    peak_memory,
    set_threads,
    update_seconds,
    write_result,
)
from finetune.optimization import decay_groups  # noqa: E402
from finetune.truncation import model_inputs  # noqa: E402


def run(spec: ArmSpec) -> dict:
    """Train and evaluate one run of the example-style loop; returns the measurements."""
    import numpy as np
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    set_threads(spec.threads)
    t_start = time.perf_counter()
    cfg = job_config(spec)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), mixed_precision=spec.precision, gradient_accumulation_steps=spec.k
    )
    tokenizer, tokenized, labels, model, metrics = load_job(cfg)
    collator = CountingCollator(tokenizer, pad_to_multiple_of=8 if accelerator.device.type == "cuda" else None)
    train = model_inputs(tokenized["train"])
    validation = model_inputs(tokenized["validation"])
    t, o = cfg.training, cfg.optim
    train_dataloader = DataLoader(train, shuffle=True, collate_fn=collator, batch_size=spec.b, drop_last=False)
    eval_dataloader = DataLoader(validation, shuffle=False, collate_fn=collator,
                                 batch_size=t.per_device_eval_batch_size)
    optimizer = torch.optim.AdamW(decay_groups(model, o.weight_decay), lr=o.learning_rate,
                                  betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon)
    updates_per_epoch = math.ceil(len(train_dataloader) / spec.k)
    total = t.max_steps if t.max_steps is not None else math.ceil((t.num_train_epochs or 1) * updates_per_epoch)
    warmup = o.warmup_steps if o.warmup_steps > 0 else math.ceil(o.warmup_ratio * total)
    lr_scheduler = get_scheduler(o.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=warmup,
                                 num_training_steps=total)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    updates = 0
    micro_batches = 0
    collator.counting = True
    begin = time.perf_counter()
    ends = []  # each update's end: the run's steady rate, and its cold start
    for _epoch in range(math.ceil(total / updates_per_epoch)):
        model.train()
        for batch in train_dataloader:
            micro_batches += 1
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and t.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                updates += 1
                ends.append(time.perf_counter())
                if updates >= total:
                    break
        if updates >= total:
            break
    seconds = time.perf_counter() - begin
    collator.counting = False

    t_eval = time.perf_counter()
    model.eval()
    predictions, references = [], []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        pred, ref = accelerator.gather_for_metrics((outputs.logits.argmax(dim=-1), batch["labels"]))
        predictions.append(pred.cpu().numpy())
        references.append(ref.cpu().numpy())
    scores = metrics.compute(np.concatenate(predictions), np.concatenate(references))
    samples, tokens = collator.consumed(micro_batches)
    return {
        "updates": updates,
        "samples": samples,
        "tokens": tokens,
        "train_seconds": seconds,
        "update_seconds": update_seconds(begin, ends),
        "eval_seconds": time.perf_counter() - t_eval,
        "total_seconds": time.perf_counter() - t_start,
        "eval": {k: float(v) for k, v in scores.items()},
        "notes": "torch AdamW defaults (no fused kernel on the CPU), shuffled batches",
        **peak_memory(),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = ArmSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    write_result(argv[1], run(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
