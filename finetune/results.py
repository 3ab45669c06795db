"""What a finished run writes: the model, ``metrics.json``, ``all_results.json``, the model card, ``curves.png``.

:func:`summarize` makes the run's summary (what ``metrics.json`` holds) and
:func:`write_outputs` writes every file of it, each atomically.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from finetune.errors import FinetuneError, OutputError
from finetune.evaluation import EVAL_BY_LABEL, EVAL_INTERVALS, EVAL_THRESHOLDS
from finetune.lora import is_lora, merged_copy, save_adapter
from finetune.outputs import (
    ADAPTER_CONFIG, ADAPTER_DIR, CURVES_FILE, METRICS_FILE, MODEL_CARD_FILE, MODEL_CARD_MARK, RESULTS_FILE, json_ready,
    write_atomic,
)
from finetune.resources import training_file
from finetune.tasks import set_model_thresholds

if TYPE_CHECKING:
    from finetune.run import Run

logger = logging.getLogger("finetune")


def summarize(run: "Run", history: list[dict[str, Any]], ended: str = "completed",
              best: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The run's summary: what ``metrics.json`` holds.

    ``train.ended`` says how training ended: ``completed`` (every planned
    update), ``early_stopped`` (``evaluation.early_stopping_patience``) or
    ``stopped_by_caller`` (``fit``'s ``on_update``; then nothing is written).

    ``eval`` holds the metrics of the saved model: the best evaluation's under
    ``evaluation.load_best_model_at_end``, else the last one's.
    """
    final = history[-1] if history else {}
    if best is not None and run.cfg.evaluation.load_best_model_at_end:
        final = next(r for r in history if r["step"] == best["step"])
    return {
        "train": {
            "updates": run.state.step,
            "skipped_updates": run.state.skipped_updates,
            "samples": run.state.samples_seen,
            "tokens": run.state.tokens_seen,
            "seconds": run.state.train_seconds,  # the whole run's, as the counts around it
            "loss": run.state.loss_sum / run.state.loss_samples if run.state.loss_samples else None,
            "train_samples": len(run.train_dataloader.dataset),
            "epoch": run.state.epoch + run.state.micro_batch / max(1, len(run.train_dataloader)),
            "effective_batch_size": run.batching.effective_batch_size,
            "per_device_train_batch_size": run.batching.per_device_batch_size,
            "gradient_accumulation_steps": run.batching.gradient_accumulation_steps,
            "accumulation_by_epoch": list(run.plan.accumulation),
            "num_processes": run.batching.num_processes,
            # Accelerate's: NO (one process), MULTI_GPU / MULTI_CPU (DDP), FSDP or DEEPSPEED
            "distributed_type": run.accelerator.distributed_type.value,
            "mixed_precision": run.accelerator.mixed_precision,
            "gradient_checkpointing": run.checkpointing.on,
            # logging.noise_scale: the gradient noise scale at the end, in samples (finetune.noise_scale), or null
            "noise_scale": run.state.noise_scale() if run.cfg.logging.noise_scale else None,
            # training.cuda_graphs as applied: the lengths captured, the seconds their capture took and the bytes
            # their memory pool holds (left out of torch.cuda.max_memory_allocated), or null
            "cuda_graphs": run.graphs.record() if run.graphs is not None else None,
            # what LoRA trained (model.lora_rank), or null: every weight
            "lora": lora_record(run.lora),
            # what model.freeze_embeddings / freeze_blocks kept as pretrained, or null: nothing
            "frozen": run.frozen.record() if run.frozen is not None else None,
            # how many training texts data.max_length cut, and what they kept
            "long_texts": run.long_texts.record() if run.long_texts is not None else None,
            # how many training texts hold words the tokenizer reads as its unknown token, and the commonest of
            # those words, or null: a tokenizer without one (finetune.unknown_words)
            "unknown_words": run.unknown_words.record() if run.unknown_words is not None else None,
            "ended": ended,
            # SHA-256 of the training rows as read (values and schema, in order): what a resume compares, and what
            # tells a run again from config.yaml whether it read the same data (a file edited, a URL's changed)
            "data_sha256": run.data_sha256,
            # the local training file or folder as an absolute path (null: a Hub data set or a URL), where a run's
            # rows are read again from any folder; config.yaml keeps the path as given, for the command again
            "data_file": training_file(run.cfg.data.train_file),
        },
        "eval": {k.removeprefix("eval/"): v for k, v in final.items() if k.startswith("eval/")},
        # the same model's precision, recall, F1 and support of each label alone, or null (regression)
        "eval_by_label": final.get(EVAL_BY_LABEL),
        # each single-label metric's 95% bootstrap interval over the validation texts, [low, high], or null
        "eval_intervals": final.get(EVAL_INTERVALS),
        # each label's threshold, by name, at which the saved model predicts (its config's label_thresholds;
        # finetune.thresholds): every label's (multi_label), the positive class's (two classes), or null
        "eval_thresholds": saved_thresholds(run, final.get(EVAL_THRESHOLDS)),
        # validation rows whose text (with its pair) a training row has too
        "validation_seen_in_training": run.seen_in_training,
        "best": best,
        # the saved model's scores on data.test_file (or data.test_split_name), as finetune score --json reports a
        # file's (finetune.test_set), or null: none given, or not yet scored
        "test": None,
        # the expected peak memory by part, in bytes (finetune.memory), or null under FSDP / DeepSpeed
        "memory_plan": run.memory.record() if run.memory is not None else None,
        "epochs": history,
        "labels": list(run.labels.names),
    }


def saved_thresholds(run: "Run", tuned: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
    """A thresholded run's thresholds by label name (every label's, multi_label; a two-class run's positive
    class's): those the saved model's evaluation chose (``tuned``, under ``per_label``), else
    ``evaluation.threshold``'s; None where the most probable class is predicted, or a number."""
    if not run.task.thresholded:
        return None
    return tuned or run.task.thresholds_by_label(run.labels.names)


def lora_record(plan) -> Optional[dict[str, Any]]:
    """``metrics.json``'s account of a :class:`~finetune.lora.LoraPlan` (``None`` without LoRA)."""
    if plan is None:
        return None
    return {"rank": plan.rank, "alpha": plan.alpha, "dropout": plan.dropout, "target_modules": list(plan.targets),
            "adapted_modules": plan.adapted, "trained_in_full": list(plan.head),
            "trainable_weights": plan.trainable, "total_weights": plan.total}


def all_results(summary: dict[str, Any]) -> dict[str, Any]:
    """``metrics.json``'s summary under the Trainer's ``all_results.json`` names, where they mean the same."""
    train = summary["train"]
    seconds = train["seconds"]
    results: dict[str, Any] = {
        "epoch": round(train["epoch"], 4),
        "train_runtime": round(seconds, 4),
        "train_samples_per_second": round(train["samples"] / seconds, 3) if seconds > 0 else None,
        "train_steps_per_second": round(train["updates"] / seconds, 3) if seconds > 0 else None,
        "train_loss": train["loss"],
        "train_samples": train["train_samples"],
        "total_updates": train["updates"],
    }
    for key, value in summary["eval"].items():
        results["eval_samples" if key == "num_samples" else f"eval_{key}"] = value
    for key, value in (summary.get("test") or {}).get("metrics", {}).items():  # the Trainer's predict() names
        results["test_samples" if key == "num_samples" else f"test_{key}"] = value
    return results


def write_outputs(run: "Run", summary: dict[str, Any], same_run: bool = False) -> None:
    """The final model, its scores on the run's test set (into ``summary["test"]``), ``metrics.json``,
    ``all_results.json``, the model card and ``curves.png``. ``same_run``: the run resumed, so that the files
    ``finetune score --card`` added to its card scored this model, and are kept.

    Each file is written to a temporary name and renamed, so a run stopped
    while writing leaves the old file or the new one.
    """
    from finetune.model_card import model_card

    out = Path(run.cfg.output.output_dir)
    if summary.get("eval_thresholds"):  # saved with the model: what finetune predict and score predict at
        thresholds = summary["eval_thresholds"]
        set_model_thresholds(run.accelerator.unwrap_model(run.model).config, list(thresholds), thresholds.values())
    save_model(run, out)
    if run.test is not None:
        from finetune.test_set import score_test_set

        summary["test"] = score_test_set(run, out)  # after the save, which it scores
    if not run.accelerator.is_main_process:
        return
    write_atomic(out / METRICS_FILE, json.dumps(json_ready(summary), indent=2) + "\n")
    write_atomic(out / RESULTS_FILE, json.dumps(json_ready(all_results(summary)), indent=2) + "\n")
    card = model_card(run.cfg, summary)
    if same_run and (out / MODEL_CARD_FILE).is_file():
        card = with_earlier_scores(card, (out / MODEL_CARD_FILE).read_text(encoding="utf-8"), out.name)
    write_model_card(out / MODEL_CARD_FILE, card)
    write_curves(out)


def with_earlier_scores(card: str, previous: str, model: str) -> str:
    """``card`` with the sections and ``model-index`` results that ``finetune score --card`` added to
    ``previous``, the same run's card before it is written again (its command run again once it had finished).
    A file that ``card`` scores itself (the run's test set) keeps its new scores."""
    from finetune.model_card import scored_dataset, scored_marks, split_card, with_scored_section

    front, body = split_card(previous)
    results = ((front or {}).get("model-index") or [{}])[0].get("results", [])
    for name in re.findall(r"<!-- finetune score: (.+?) -->", body):
        start, end = scored_marks(name)
        entry = next((r for r in results if r.get("dataset") == scored_dataset(name)), None)
        if start in card or end not in body or entry is None:
            continue
        card = with_scored_section(card, model, name, entry, body[body.index(start):body.index(end) + len(end) + 1])
    return card


def save_model(run: "Run", directory: str | os.PathLike) -> None:
    """Save model (safetensors) and tokenizer so ``transformers.pipeline`` can load them.

    A LoRA run saves the model with its adapters merged in, and the adapter
    alone in ``adapter/`` (:mod:`finetune.lora`).

    They are written into a temporary folder beside, then each file is renamed
    into ``directory``: a stop while writing leaves every file whole, old or new.
    """
    acc = run.accelerator
    acc.wait_for_everyone()
    unwrapped = acc.unwrap_model(run.model)
    adapted = is_lora(unwrapped)
    state_dict = None if adapted else acc.get_state_dict(run.model)
    if acc.is_main_process:
        directory = Path(directory)
        staging = directory / ".tmp-model"
        if staging.exists():
            shutil.rmtree(staging)
        if adapted:  # the merged model where transformers looks, the adapter beside it for PEFT
            merged_copy(unwrapped).save_pretrained(staging, safe_serialization=True)
            save_adapter(unwrapped, staging / ADAPTER_DIR)
        else:
            unwrapped.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
        run.tokenizer.save_pretrained(staging)
        for file in sorted(staging.iterdir()):
            if file.is_dir():
                _clear_earlier_adapter(directory / file.name)
            os.replace(file, directory / file.name)
        staging.rmdir()
    acc.wait_for_everyone()


def _clear_earlier_adapter(folder: Path) -> None:
    """An earlier run's ``adapter/`` is replaced whole, never mixed with this run's files; a folder of that
    name that holds no adapter is the user's, and the save stops rather than touch it.

    Raises:
        OutputError: for a folder named ``adapter`` that finetune did not write.
    """
    if not folder.exists():
        return
    if not (folder / ADAPTER_CONFIG).is_file():
        raise OutputError(f"{folder}: a folder finetune did not write is in the way of the LoRA adapter; move it")
    shutil.rmtree(folder)


def write_model_card(path: Path, card: str) -> bool:
    """Write the model card, unless ``path`` is a README the user wrote (then warn and keep it)."""
    if path.exists() and MODEL_CARD_MARK not in path.read_text(encoding="utf-8", errors="replace"):
        logger.warning("%s was not written by finetune: kept as it is, and no model card written", path)
        return False
    write_atomic(path, card)
    return True


def write_curves(out: Path) -> None:
    """``curves.png`` from the run's log; a missing matplotlib costs the picture, not the run."""
    from finetune.plot import plot_curves

    try:
        plot_curves(out)
    except FinetuneError as exc:
        logger.warning("%s not written: %s", out / CURVES_FILE, exc.message)
