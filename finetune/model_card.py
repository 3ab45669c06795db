"""What others read in an output folder: the model card (``README.md``) and ``all_results.json``.

The card's YAML front matter uses the Hub's model-card metadata (``base_model``,
``datasets``, ``metrics``, ``model-index``), so a folder pushed to the Hub
shows its results; the body says in words what was trained on what, with
which batches and schedule, what it scored, and the command that trains it
again. ``all_results.json`` repeats the summary under the key names the
Trainer writes (``train_runtime``, ``train_samples_per_second``,
``eval_<metric>``, ``epoch``), for tools written against Trainer outputs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from finetune.data_sources import data_sources
from finetune.errors import ConfigError
from finetune.launch import train_command
from finetune.metrics import averaged_over_absent_labels
from finetune.metrics.ranking import RANKING_METRICS
from finetune.modeling import hub_id, model_name
from finetune.outputs import CONFIG_FILE, MODEL_CARD_FILE, MODEL_CARD_MARK
from finetune.schema import PER_LABEL
from finetune.thresholds import format_thresholds
from finetune.unknown_words import card_lines as unknown_words_lines

# metric names as the Hub's model-index spells them, and how the card titles them
_TITLES = {"accuracy": "Accuracy", "f1": "F1", "precision": "Precision", "recall": "Recall",
           "matthews_correlation": "Matthews correlation", "loss": "Loss", "pearson": "Pearson",
           "spearmanr": "Spearman", "mse": "MSE", "mae": "MAE", "subset_accuracy": "Subset accuracy"}


def _sharded(distributed_type: Optional[str]) -> list[str]:
    """For a run Accelerate launched under FSDP or DeepSpeed: what the command (DDP's launch) leaves out. The
    launcher's config file is not known to the run, and the updates do not depend on the engine."""
    engine = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}.get(distributed_type or "")
    if engine is None:
        return []
    return [f"It ran under {engine}: launched as above, DDP makes the same updates (to rounding) where the model fits "
            f"on each GPU whole; to shard it again, launch with the {engine} config it ran under (`--config_file`) in "
            f"place of `--multi_gpu`.", ""]


def _same_data(digest: Optional[str]) -> list[str]:
    """How to tell that a run again read the same training rows (a card written before the digest was kept has
    none)."""
    if not digest:
        return []
    return [f"It read the same training rows where its `metrics.json` holds the same `train.data_sha256`: "
            f"`{digest}`.", ""]


def reproduce_command(num_processes: int, output_dir: str) -> str:
    """The command that trains this model again from the folder's ``config.yaml``, into a new folder."""
    args = ["--config", f"{output_dir}/{CONFIG_FILE}", f"output.output_dir={output_dir}-again"]
    return shlex.join(train_command(num_processes) + args)


def _use(cfg) -> list[str]:
    """The card's ``## Use``: ``finetune predict``, which applies what the run decided (its thresholds, its
    windows), and transformers' pipeline, called with the model's input (a text, or a pair) and saying what it
    returns for the problem type."""
    folder, data = cfg.output.output_dir, cfg.data
    if data.text_pair_column is None:
        text, predict = '"a text"', shlex.join(["finetune", "predict", folder, "a text"])
    else:  # the command reads pairs from a file only
        text = '{"text": "a first text", "text_pair": "its second text"}'
        predict = (f"{shlex.join(['finetune', 'predict', folder, '--file', 'pairs.csv'])}  # with the columns "
                   f"{data.text_column!r} and {data.text_pair_column!r}")
    call = {"single_label": f"classifier({text})  # the most probable class, with its probability",
            "multi_label": f"classifier({text}, top_k=None)  # every label, with its probability (a sigmoid's)",
            "regression": f"classifier({text})  # the predicted number, as the score of {data.label_column!r}"}
    return ["## Use", "", "```bash", predict, "```", "", "```python", "from transformers import pipeline", "",
            f"classifier = pipeline(\"text-classification\", model={json.dumps(folder)})",
            call[cfg.model.problem_type], "```", ""]


def _front_matter(cfg, name: str, metrics: dict[str, float]) -> dict[str, Any]:
    """The Hub's model-card metadata: base model, data set, metrics and a ``model-index`` of the results.

    ``base_model`` and ``datasets`` hold Hub ids only, so they are left out
    where the model or the data has none (a local folder, a local file); the
    ``model-index`` names the data set and split the results were computed on.
    """
    front: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-classification",
                             "tags": ["finetune", "text-classification"]}
    base = hub_id(cfg.model.name_or_path)
    if base:
        front["base_model"] = base
    sources = data_sources(cfg.data, cfg.split_seed)
    if sources.hub_id:
        front["datasets"] = [sources.hub_id]
    if metrics:
        # a local data set's type is its name, without the slash of a folder and the one above it
        # (`bbcnews/data`), which the Hub would read as a data set's id
        dataset = {"name": sources.results_name, "type": sources.hub_id or sources.results_name.replace("/", "-"),
                   "split": sources.results_split}
        if sources.hub_config:
            dataset["config"] = sources.hub_config
        front["metrics"] = [m for m in metrics if m != "loss"] or ["loss"]
        front["model-index"] = [{"name": name, "results": [_index_result(dataset, metrics)]}]
    return front


def _index_result(dataset: dict[str, str], metrics: dict[str, float]) -> dict[str, Any]:
    """One result of the ``model-index``: the metrics on ``dataset`` (its name, type and split)."""
    return {"task": {"type": "text-classification", "name": "Text Classification"}, "dataset": dataset,
            "metrics": [{"type": m, "value": float(v), "name": _TITLES.get(m, m)} for m, v in metrics.items()]}


# what Accelerate's mixed_precision values mean for the arithmetic, in words
_ARITHMETIC = {"no": "fp32 throughout (no mixed precision)",
               "bf16": "bf16 autocast, fp32 weights and optimizer state",
               "fp16": "fp16 autocast with loss scaling, fp32 weights and optimizer state"}


def _batching(train: dict[str, Any]) -> str:
    """The effective batch as ``b x k x P``, epoch by epoch under an accumulation schedule."""
    b, k, P = train["per_device_train_batch_size"], train["gradient_accumulation_steps"], train["num_processes"]
    by_epoch = train.get("accumulation_by_epoch") or [k]
    if len(set(by_epoch)) > 1:
        return "accumulation by epoch " + ", ".join(f"epoch {e}: {b} x {kk} x {P} = {b * kk * P}"
                                                     for e, kk in enumerate(by_epoch))
    return f"{b} x {k} x {P} = {train['effective_batch_size']} samples per update (b x k x P)"


def _predicts(problem_type: str, labels: list[str]) -> str:
    names = ", ".join(f"`{x}`" for x in labels)
    if problem_type == "regression":
        return f"It predicts a number, `{labels[0]}` (regression, trained on squared error)."
    if problem_type == "multi_label":
        return (f"It predicts any number of {len(labels)} labels (multi-label: a sigmoid per label, "
                f"over the label's threshold counts): {names}.")
    return f"It predicts one of {len(labels)} labels: {names}."


def _thresholds(evaluation, thresholds: Optional[dict[str, float]], labels: Sequence[str],
                problem_type: str) -> list[str]:
    """The card's line on a thresholded model's thresholds: a multi-label model's, or a two-class model's on its
    positive class (none where the most probable class is predicted)."""
    if not thresholds:
        return []
    if problem_type == "single_label":
        (positive, threshold), = thresholds.items()
        other = next(name for name in labels if name != positive)
        how = (", chosen on the validation texts (`evaluation.threshold: per_label`: the one of its best F1 where that "
               "beats 0.5 on 95% of resamples of them, else 0.5; the results below are at it, so they lean high)"
               if evaluation.threshold == PER_LABEL else " (`evaluation.threshold`)")
        return [f"- Threshold: `{positive}` where its probability is over {threshold:.4g}{how}, else `{other}`; "
                "in `config.json` as `label_thresholds`, which `finetune predict` applies and `pipeline()` does not "
                "(it returns the most probable class)"]
    if isinstance(evaluation.threshold, dict):
        return [f"- Thresholds: {format_thresholds(list(thresholds), list(thresholds.values()))} "
                "(`evaluation.threshold`, by label); in `config.json` as `label_thresholds`, which `finetune predict` "
                "applies and `pipeline()` does not"]
    if evaluation.threshold != PER_LABEL:
        return [f"- Thresholds: {evaluation.threshold:g} for every label (`evaluation.threshold`)"]
    return [f"- Thresholds: {format_thresholds(list(thresholds), list(thresholds.values()))}, each label's chosen on "
            f"the validation texts for the best {evaluation.average} F1 (`evaluation.threshold: per_label`: kept "
            "where together they beat 0.5 on 95% of resamples of them, else 0.5; the results below are at them, so "
            "they lean high); in `config.json` as `label_thresholds`, which `finetune predict` applies and "
            "`pipeline()` does not"]


def _averaging(evaluation, problem_type: str, by_label: Optional[dict[str, dict[str, Any]]]) -> list[str]:
    """The line saying whose F1, precision and recall the results give, as the run decided ``evaluation.average``
    (none where it was left undecided, ``auto``), and the caution the start line gave where the validation texts
    lack a class that average counts as 0 whatever the model predicts."""
    averaged = ["F1" if name == "f1" else name for name in evaluation.metrics if name in ("f1", "precision", "recall")]
    if not averaged or problem_type == "regression" or evaluation.average == "auto":
        return []
    how = (f"of `{evaluation.positive_label}`, the positive class" if evaluation.average == "binary"
           else f"the {evaluation.average} average over the labels")
    named = ", ".join(averaged[:-1]) + f" and {averaged[-1]}" if len(averaged) > 1 else averaged[0]
    caution = averaged_over_absent_labels(evaluation.metrics, evaluation.average, evaluation.positive_label,
                                          {label: s["support"] for label, s in (by_label or {}).items()},
                                          "validation text", labels=problem_type == "multi_label")
    return [f"- {named[0].upper()}{named[1:]}: {how} (`evaluation.average: {evaluation.average}`)",
            *([f"- Caution: {caution}"] if caution else [])]


def _long_texts(record: Optional[dict[str, Any]]) -> list[str]:
    """The line on the training texts the window cut (none when every text fit)."""
    if not record or not record["longer_than_max_length"]:
        return []
    if record["truncation"] == "chunks":
        done = (f"were split into {record['kept']} ({record['chunks']:,} windows in all; a text's prediction "
                f"is the mean of its windows' logits)")
        same = "`finetune predict` splits and averages the same way; `pipeline()` sees one window"
    else:
        done, same = f"kept their {record['kept']}", "`finetune predict` cuts texts the same way"
    return [f"- Long texts: {record['longer_than_max_length']} of {record['rows']} training texts were longer than "
            f"{record['max_length']} tokens (the longest {record['longest_tokens']:,}) and {done} "
            f"(`data.truncation: {record['truncation']}`); {same}"]


def _schedule(optim) -> str:
    """``cosine schedule``; with the schedule's own arguments, ``warmup_stable_decay schedule (num_decay_steps=4)``."""
    arguments = ", ".join(f"{k}={v}" for k, v in optim.lr_scheduler_kwargs.items())
    return f"{optim.lr_scheduler_type} schedule" + (f" ({arguments})" if arguments else "")


def _adapters(lora: Optional[dict[str, Any]]) -> list[str]:
    """The card's line on LoRA, when the run trained adapters."""
    if not lora:
        return []
    share = 100.0 * lora["trainable_weights"] / max(1, lora["total_weights"])
    return [f"- Weights trained: LoRA adapters of rank {lora['rank']} (alpha {lora['alpha']:g}) on "
            f"{', '.join(f'`{t}`' for t in lora['target_modules'])}, and the head "
            f"({', '.join(f'`{h}`' for h in lora['trained_in_full'])}) in full: {lora['trainable_weights']:,} of "
            f"{lora['total_weights']:,} ({share:.2f}%). The weights here have the adapters merged in; the adapter "
            f"alone, for PEFT, is in `adapter/`."]


def _left_out(data, problem_type: str) -> list[str]:
    """The card's lines on the rows and labels the data settings left out: ``data.drop_labels``' labels, and
    the rows without a label under ``data.on_missing_label: drop``."""
    lines = []
    if data.on_missing_label == "drop":
        lines.append("- Texts left out: those without a label, in the training and the validation data "
                     "(`data.on_missing_label: drop`).")
    if data.drop_labels:
        labels = " and ".join(f"`{label}`" for label in data.drop_labels)
        lines.append(f"- Labels left out: {labels}, taken out of each text's labels (`data.drop_labels`)."
                     if problem_type == "multi_label" else f"- Texts left out: those labelled {labels}, in the "
                     f"training and the validation data (`data.drop_labels`).")
    return lines


def _frozen(frozen: Optional[dict[str, Any]]) -> list[str]:
    """The card's line on the weights kept as pretrained, when the run froze some."""
    if not frozen:
        return []
    blocks = frozen["blocks"]
    which = f" and the lowest {blocks} transformer block{'s' if blocks > 1 else ''}" if blocks else ""
    share = 100.0 * frozen["frozen_weights"] / max(1, frozen["total_weights"])
    return [f"- Weights kept as pretrained: the embeddings{which}, {frozen['frozen_weights']:,} of "
            f"{frozen['total_weights']:,} ({share:.1f}%)."]


def _results(data: str, results: dict[str, Any], metrics: dict[str, float],
             by_label: Optional[dict[str, dict[str, float]]], seen: int = 0,
             intervals: Optional[dict[str, list[float]]] = None) -> list[str]:
    """A results section: the saved model's metrics on ``data`` (the validation data, or a file scored after
    training), with their bootstrap intervals where they were computed, then each label's."""
    texts = f" ({results['num_samples']} texts)" if "num_samples" in results else ""
    # a reader of the scores should know how many of their texts the model was trained on
    said = ("1 of these texts is also a training text: the model was trained on it." if seen == 1 else
            f"{seen} of these texts are also training texts: the model was trained on them.")
    trained_on = [said, ""] if seen else []
    heads, rows, said = ["metric", "value"], [[_TITLES.get(m, m), f"{v:.4f}"] for m, v in metrics.items()], []
    if intervals:  # a third column, and what it is
        from finetune.metrics import POINT_INTERVAL, SPREAD

        heads.append("95% interval")
        for row, m in zip(rows, metrics):
            row.append("{:.4f} to {:.4f}".format(*intervals[m]) if m in intervals else "")
        point = f" {POINT_INTERVAL}" if any(low == high for low, high in intervals.values()) else ""
        said = [f"The interval: {SPREAD}.{point}", ""]
    table = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads), *("| " + " | ".join(r) + " |" for r in rows)]
    return [f"## Results on {data}{texts}", "", *trained_on, *table, "", *said, *_by_label(by_label)]


# the split a file scored after training is filed under in the model-index, which tells its result from the
# validation data's (a validation file and a scored file may share a name)
SCORED_SPLIT = "all rows, scored after training"
_FRONT_MATTER = re.compile(r"\A---\n(.*?\n)---\n", re.DOTALL)


def card_of(output_dir: str | os.PathLike) -> Path:
    """The model card of a run's folder that ``finetune score --card`` may add a file's scores to.

    Raises:
        ConfigError: for a folder without a card finetune wrote (a checkpoint's, or a README of the user's).
    """
    path = Path(output_dir) / MODEL_CARD_FILE
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    if MODEL_CARD_MARK not in text or not _FRONT_MATTER.match(text):
        raise ConfigError(f"--card: {path} is not a model card a finetune run wrote; score the run's own folder "
                          "(a checkpoint has no card), or leave out --card")
    return path


def card_with_scores(card: str, model: str, data: str, results: dict[str, Any],
                     by_label: Optional[dict[str, dict[str, float]]] = None, seen: Optional[int] = 0,
                     intervals: Optional[dict[str, list[float]]] = None, arithmetic: str = "no") -> str:
    """``card`` with the scores ``finetune score`` measured on the labelled file named ``data``: a result of the
    front matter's ``model-index`` (which the Hub shows beside the model) and a section of the body before
    ``## Use``. Scores of a file of that name added before are replaced, not repeated.

    Args:
        model: The model's name in the ``model-index`` (the run folder's name), where the card has none yet.
        results: ``{"loss", "num_samples", <metric>: value}``; the rest as :func:`_results` takes them, and
            ``seen`` ``None`` where the file's texts were not looked for among the run's training rows.
        arithmetic: The forward passes' (``no``, ``bf16``, ``fp16``), said where it was not float32.
    """
    metrics = {k: v for k, v in results.items() if k != "num_samples" and isinstance(v, (int, float))}
    entry = _index_result(scored_dataset(data), metrics)
    start, end = scored_marks(data)
    notes = [f"Computed in {arithmetic} autocast."] if arithmetic != "no" else []
    if seen is None:  # what a reader would take for none of them
        notes.append("Whether any of these texts is also a training text was not checked.")
    section = "\n".join([start, *_results(f"{data}, scored after training", results, metrics, by_label, seen or 0,
                                           intervals), *(f"{note}\n" for note in notes), end, ""])
    return with_scored_section(card, model, data, entry, section)


def split_card(card: str) -> tuple[Optional[dict[str, Any]], str]:
    """A card's front matter, parsed (``None`` where it has none), and its body."""
    found = _FRONT_MATTER.match(card)
    return (yaml.safe_load(found.group(1)) or {}, card[found.end():]) if found else (None, card)


def scored_dataset(data: str) -> dict[str, str]:
    """The ``model-index`` dataset of a file ``finetune score --card`` scored."""
    return {"name": data, "type": data.replace("/", "-"), "split": SCORED_SPLIT}


def scored_marks(data: str) -> tuple[str, str]:
    """The comments around the card's section of the file ``data`` that ``finetune score --card`` scored."""
    return f"<!-- finetune score: {data} -->", f"<!-- end of finetune score: {data} -->"


def with_scored_section(card: str, model: str, data: str, entry: dict[str, Any], section: str) -> str:
    """``card`` with a scored file's ``model-index`` result ``entry`` and body ``section`` (before ``## Use``),
    each in place of one of the same file's."""
    front, body = split_card(card)
    index = front.setdefault("model-index", [{"name": model, "results": []}])[0].setdefault("results", [])
    index[:] = [r for r in index if r.get("dataset", {}) != entry["dataset"]] + [entry]
    scored = [m["type"] for m in entry["metrics"] if m["type"] != "loss"]
    front["metrics"] = list(dict.fromkeys(front.get("metrics", []) + scored))
    start, end = scored_marks(data)
    if start in body and end in body:  # scored before: the section in its place
        body = body[:body.index(start)] + section + body[body.index(end) + len(end) + 1:]
    elif "\n## Use\n" in body:
        at = body.index("\n## Use\n") + 1
        body = body[:at] + section + "\n" + body[at:]
    else:
        body = body.rstrip("\n") + "\n\n" + section
    return "\n".join(["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", ""]) + body


# past this many labels the card shows the weakest of them (metrics.json keeps them all)
CARD_LABELS = 20


def _by_label(by_label: Optional[dict[str, dict[str, float]]]) -> list[str]:
    """The results' table of each label scored alone, and a blank line; nothing for regression."""
    if not by_label:
        return []
    shown, title = list(by_label.items()), "Each label scored alone:"
    if len(shown) > CARD_LABELS:
        shown = sorted(shown, key=lambda item: item[1]["f1"])[:CARD_LABELS]
        title = (f"The {CARD_LABELS} labels of lowest F1, of {len(by_label)}, each scored alone "
                 f"(all of them: `eval_by_label` in `metrics.json`):")
    ranked = [key for key in RANKING_METRICS if key in shown[0][1]]  # where the run asked for them
    rows = [f"| {_cell(name)} | {s['precision']:.4f} | {s['recall']:.4f} | {s['f1']:.4f} | {s['support']} |"
            + "".join(f" {s[key]:.4f} |" for key in ranked) for name, s in shown]
    return [title, "", "| label | precision | recall | F1 | support |" + "".join(f" {key} |" for key in ranked),
            "|---|---|---|---|---|" + "---|" * len(ranked), *rows, ""]


def _linked(name: str, spec: Optional[str]) -> str:
    """The training data's name, linked to where it was downloaded from when it is a web address."""
    return f"[{name}]({spec})" if spec and re.match(r"https?://", spec) else name


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a "|" in a label would split its row


def model_card(cfg, summary: dict[str, Any]) -> str:
    """The ``README.md`` of an output folder."""
    train, results = summary["train"], summary["eval"]
    known = hub_id(cfg.model.name_or_path)
    base = f"`{known}`" if known else model_name(cfg.model.name_or_path)  # an id in code type, words as words
    sources = data_sources(cfg.data, cfg.split_seed)
    labels = summary["labels"]
    metrics = {k: v for k, v in results.items() if k != "num_samples" and isinstance(v, (int, float))}
    name = Path(cfg.output.output_dir).name
    front = _front_matter(cfg, name, metrics)
    optim = cfg.optim
    warmup = f"{optim.warmup_steps} updates" if optim.warmup_steps else f"ratio {optim.warmup_ratio:g}"
    best = summary.get("best")
    chosen = ""
    if best:
        which = "the best evaluation's" if cfg.evaluation.load_best_model_at_end else "the last update's"
        chosen = (f" Evaluations were compared on `{best['metric']}`; the best was at update {best['step']}"
                  f" ({best['value']:.4g}); the weights here are {which}.")
    stopped = (" The run ended early: the validation metric stopped improving."
               if train.get("ended") == "early_stopped" else "")
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        MODEL_CARD_MARK,
        "",
        f"# {name}",
        "",
        f"A text classifier fine-tuned from {base} on {_linked(sources.train, cfg.data.train_file)} with "
        f"finetune. {_predicts(cfg.model.problem_type, labels)}"
        f"{chosen}{stopped}",
        "",
        "## Training",
        "",
        f"- Effective batch: {_batching(train)}",
        f"- Updates: {train['updates']} over {train['epoch']:.2f} epochs of {train['train_samples']} texts"
        + (" (drawn by `data.max_train_samples`)" if cfg.data.max_train_samples == train["train_samples"] else ""),
        f"- Optimizer: AdamW, learning rate {optim.learning_rate:g} ({_schedule(optim)}, "
        f"warmup {warmup}), weight decay {optim.weight_decay:g}",
        f"- Arithmetic: {_ARITHMETIC.get(train['mixed_precision'], train['mixed_precision'])}; "
        f"max length {cfg.data.max_length} tokens; seed {cfg.training.seed}",
        *_left_out(cfg.data, cfg.model.problem_type),
        *_long_texts(train.get("long_texts")),
        *unknown_words_lines(train.get("unknown_words")),
        *_adapters(train.get("lora")),
        *_frozen(train.get("frozen")),
        *_thresholds(cfg.evaluation, summary.get("eval_thresholds"), labels, cfg.model.problem_type),
        *_averaging(cfg.evaluation, cfg.model.problem_type, summary.get("eval_by_label")),
        "",
        *_results(f"the validation data: {sources.validation}", results, metrics, summary.get("eval_by_label"),
                  summary.get("validation_seen_in_training", 0), summary.get("eval_intervals")),
        *_use(cfg),
        "## Reproduce",
        "",
        "```bash",
        reproduce_command(train["num_processes"], cfg.output.output_dir),
        "```",
        "",
        *_sharded(train.get("distributed_type")),
        *_same_data(train.get("data_sha256")),
    ]
    card, test = "\n".join(lines), summary.get("test")
    if not test:
        return card
    # the test set's scores as finetune score --card adds a file's: it was scored by the saved model after training
    return card_with_scores(card, name, test["file"], test["metrics"], test["by_label"], test["seen_in_training"],
                            test["intervals"], test["precision"])
