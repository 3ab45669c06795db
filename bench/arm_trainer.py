"""Arm (b): the same job through ``transformers.Trainer``.

The Trainer gets the job's model, data split, effective batch, AdamW settings
(learning rate, betas, epsilon, weight decay off biases and LayerNorm),
linear schedule with the same warmup fraction, clipping, precision, length
and seed, and otherwise its defaults (its fused AdamW included, and random
batches: its ``train_sampling_strategy`` is left at ``random`` unless a lever
asks for ``group_by_length``). With the ``package_order`` option it instead
draws its batches in the package's own sample order
(:class:`finetune.sampling.EpochSampler` with the job's seed and windows), so
at ``b = B`` each of its updates sees the same samples as the package's: the
accuracy comparison then isolates the arithmetic from the luck of the order.
Training throughput is timed from
``on_train_begin`` to ``on_train_end`` with evaluation and saving off;
samples and non-pad tokens are counted by the collator during that phase.
Evaluation runs afterwards with ``Trainer.predict`` and the package's metrics.

Run by ``bench/run.py``: ``python -m bench.arm_trainer SPEC_JSON OUT_JSON``.
"""

from __future__ import annotations

import sys
import tempfile
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


def run(spec: ArmSpec) -> dict:
    """Train and evaluate one Trainer run; returns the measurements."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    set_threads(spec.threads)
    t_start = time.perf_counter()
    cfg = job_config(spec)
    tokenizer, tokenized, labels, model, metrics = load_job(cfg)
    cuda = torch.cuda.is_available()
    collator = CountingCollator(tokenizer, pad_to_multiple_of=8 if cuda else None)
    strategy = "group_by_length" if "group_by_length" in spec.options else "random"
    package_order = "package_order" in spec.options

    clock = {}

    class TrainingPhase(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            collator.counting = True
            clock["begin"] = time.perf_counter()
            clock["steps"] = []

        def on_step_end(self, args, state, control, **kwargs):
            clock["steps"].append(time.perf_counter())  # an update's end: the run's steady rate, and its cold start

        def on_train_end(self, args, state, control, **kwargs):
            clock["end"] = time.perf_counter()
            collator.counting = False

    t, o = cfg.training, cfg.optim
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=spec.b,
            gradient_accumulation_steps=spec.k,
            per_device_eval_batch_size=t.per_device_eval_batch_size,
            learning_rate=o.learning_rate,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_epsilon=o.adam_epsilon,
            lr_scheduler_type=o.lr_scheduler_type,
            max_grad_norm=t.max_grad_norm or 0.0,
            num_train_epochs=t.num_train_epochs or 1.0,
            max_steps=t.max_steps if t.max_steps is not None else -1,
            bf16=spec.precision == "bf16",
            use_cpu=not cuda,
            seed=t.seed,
            **_sampling_and_warmup_for_this_release(TrainingArguments, strategy, o),
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer_class = PackageOrderTrainer(cfg, spec, tokenized["train"]["length"]) if package_order else Trainer
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=tokenized["train"],
            data_collator=collator,
            callbacks=[TrainingPhase()],
        )
        train_output = trainer.train()
        seconds = clock["end"] - clock["begin"]
        t_eval = time.perf_counter()
        prediction = trainer.predict(tokenized["validation"])
        eval_seconds = time.perf_counter() - t_eval
    predictions = prediction.predictions.argmax(-1)
    scores = metrics.compute(predictions, prediction.label_ids)
    # a run stopped by max_steps inside its first epoch used exactly updates * k micro-batches
    used = int(train_output.global_step) * spec.k if spec.max_steps is not None else None
    samples, tokens = collator.consumed(used)
    return {
        "updates": int(train_output.global_step),
        "samples": samples,
        "tokens": tokens,
        "train_seconds": seconds,
        "update_seconds": update_seconds(clock["begin"], clock["steps"]),
        "eval_seconds": eval_seconds,
        "total_seconds": time.perf_counter() - t_start,
        "eval": {k: float(v) for k, v in scores.items()},
        "trainer_train_loss": float(train_output.training_loss),
        "notes": f"{'package sample order' if package_order else f'train_sampling_strategy={strategy}'}, "
                 f"optim={args.optim}",
        **peak_memory(),
    }


def PackageOrderTrainer(cfg, spec: ArmSpec, lengths):
    """A ``Trainer`` subclass whose training sampler is the package's own (:func:`finetune.dataloaders.training_sampler`)."""
    from transformers import Trainer

    from finetune.accumulation import Batching
    from finetune.dataloaders import training_sampler

    class _Trainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return training_sampler(cfg, lengths, Batching(spec.b, spec.k, 1))

    return _Trainer


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = ArmSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    write_result(argv[1], run(spec))
    return 0


def _sampling_and_warmup_for_this_release(arguments_class, strategy: str, optim) -> dict:
    """The sampler and the warmup in the installed release's names.

    transformers 5 takes ``train_sampling_strategy`` and a warmup fraction as a
    float ``warmup_steps`` (rounded up, as the package does); 4.x took
    ``group_by_length`` and ``warmup_ratio``.
    """
    import dataclasses

    names = {f.name for f in dataclasses.fields(arguments_class)}
    fraction = optim.warmup_steps <= 0
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": strategy,
                "warmup_steps": optim.warmup_ratio if fraction else optim.warmup_steps}
    warmup = {"warmup_ratio": optim.warmup_ratio} if fraction else {"warmup_steps": optim.warmup_steps}
    return {"group_by_length": strategy == "group_by_length", **warmup}


if __name__ == "__main__":
    sys.exit(main())
