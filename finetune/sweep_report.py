"""What a sweep writes in its folder, from its studies: ``trials.csv``, ``sweep.md``, ``best.yaml`` and ``sweep.png``;
after its folds, ``folds/predictions.csv``.

Every worker rewrites them after each trial it ends, from the studies'
records, so they are current whichever worker ran what. A trial and the
continuations that resumed it are one row (they share one folder).
"""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from finetune.outputs import METRICS_FILE, write_atomic
from finetune.search_space import SearchSpace, overrides, render
from finetune.study import BEYOND_BUDGET, EVAL_LOSS, FAILED, FEW_UPDATES_ATTR, FOLDER, INTERRUPTED, PRUNED, SAME_AS, \
    STOPPED_SWEEP, redact
from finetune.sweep_file import Repeats, describe_pruner
from finetune.sweep_notes import few_updates_in_search

TRIALS_CSV, SWEEP_MD, BEST_YAML, SWEEP_PNG = "trials.csv", "sweep.md", "best.yaml", "sweep.png"
# the folders best.yaml's run, and a run of the sweep's own config on every row, write to
BEST_DIR, EVERY_ROW_DIR = "best", "all-rows"


@dataclass(frozen=True)
class Header:
    """What the report's first lines say: the objective and how the search was run."""

    metric: str
    greater_is_better: bool
    space: SearchSpace
    sampler: str
    pruner: str
    storage: str
    trials: int
    command: str
    # the run's config and the command line's overrides, from which best.yaml is made
    config: Optional[str] = None
    overrides: tuple[str, ...] = ()
    # the config's training.num_train_epochs, which the note of trials of few updates scales
    epochs: Optional[float] = None


def state_of(trial) -> str:
    """A trial's ending in words: complete, same, pruned, failed, input error, interrupted, running."""
    attrs, state = trial.user_attrs, trial.state.name
    if state == "COMPLETE":
        return "same" if SAME_AS in attrs else "complete"
    if state == "FAIL":
        if attrs.get(INTERRUPTED):
            return "interrupted"
        return "input error" if attrs.get(STOPPED_SWEEP) else "failed"
    return state.lower()


def trial_rows(trials: list, root: Path) -> list[dict[str, Any]]:
    """One row per trial folder of the study's ``trials``, in the order they were drawn: the last attempt's
    ending and value."""
    rows: dict[str, dict[str, Any]] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        folder = trial.user_attrs.get(FOLDER)
        if folder is None or trial.user_attrs.get(BEYOND_BUDGET):
            continue  # queued and not started, or never run
        row = rows.setdefault(folder, {"trial": trial.number, "folder": folder, "state": "", "value": None,
                                       "eval_loss": None, **trial.params, "updates": None, "seconds": 0.0,
                                       "attempts": 0, "note": ""})
        row["attempts"] += 1
        row["state"] = state_of(trial)
        # a pruned trial's value would be its last report, not a finished run's: it has none
        row["value"] = trial.value if row["state"] in ("complete", "same") else None
        row["eval_loss"] = trial.user_attrs.get(EVAL_LOSS) if row["value"] is not None else None
        if trial.datetime_start is not None:
            end = trial.datetime_complete
            row["seconds"] += round((end - trial.datetime_start).total_seconds(), 1) if end else 0.0
        row["note"] = note_of(trial)
        row["updates"] = updates_of(root / folder)
    return list(rows.values())


def note_of(trial) -> str:
    attrs = trial.user_attrs
    if SAME_AS in attrs:
        return f"same values as trial {attrs[SAME_AS]}: its result, not trained again"
    return attrs.get(PRUNED) or attrs.get(INTERRUPTED) or attrs.get(FAILED) or ""


def updates_of(folder: Path) -> Optional[int]:
    """The updates a trial's run (its first seed's) trained, from its log."""
    logs = sorted(folder.glob("train_log.jsonl")) or sorted(folder.glob("seed-*/train_log.jsonl"))
    if not logs:
        return None
    last = None
    with open(logs[0], encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if "train/loss" in record:
                last = record["step"]
    return last


def best_trial(trials: list, greater_is_better: bool):
    """Of a study's ``trials``, the finished one with the best value, or ``None`` before any finished. Of trials
    with the same value (an accuracy over a few hundred texts takes few values), the one whose saved model has the
    lowest validation loss, then the first drawn."""
    return min(finished_trials(trials), default=None,
               key=lambda t: (*ranking(t.value, t.user_attrs.get(EVAL_LOSS), greater_is_better), t.number))


def finished_trials(trials: list) -> list:
    """The trials that have a value: complete, or ``same`` (another's result taken)."""
    return [t for t in trials if state_of(t) in ("complete", "same")]


def ranking(value: Optional[float], eval_loss: Optional[float], greater_is_better: bool) -> tuple:
    """A trial's sort key, best first: its value in the objective's direction (none last), then its saved
    model's validation loss (unknown last: a study from before they were kept)."""
    return (value is None, -(value or 0) if greater_is_better else (value or 0),
            math.inf if eval_loss is None else eval_loss)


def tied_for_best(trials: list, greater_is_better: bool) -> list:
    """The finished trials with the best value (a trial that took another's result, ``same``, among them)."""
    scored = finished_trials(trials)
    if not scored:
        return []
    best = (max if greater_is_better else min)(t.value for t in scored)
    return [t for t in scored if t.value == best]


def write_reports(root: Path, header: Header, search, repeats: Optional[Repeats],
                  repeat_values: list[tuple[int, float]]) -> Optional[str]:
    """Rewrite the four files from the search's study (or ``None``) and the repeated runs' values (each seed's or
    fold's, with ``repeats`` saying which). Returns the note ``sweep.md`` gives of the trials that made too few
    updates (:func:`finetune.sweep_notes.few_updates_in_search`), or ``None``."""
    # read once: another worker's trial may end between two reads, and be the best of the second but running in
    # the first
    trials = search.get_trials(deepcopy=False) if search is not None else []
    rows = trial_rows(trials, root)
    few = few_updates_in_search(rows, header.epochs) if search is not None and \
        search.user_attrs.get(FEW_UPDATES_ATTR) else None
    winner = best_trial(trials, header.greater_is_better)
    best = next(r for r in rows if r["folder"] == winner.user_attrs[FOLDER]) if winner is not None else None
    if best is not None:  # the other trials of its value, each drawn values of their own
        best = {**best, "tied": [t.number for t in tied_for_best(trials, header.greater_is_better)
                                 if t.number != winner.number and SAME_AS not in t.user_attrs]}
    if rows:
        write_atomic(root / TRIALS_CSV, trials_csv(rows))
    if best is not None:
        write_atomic(root / BEST_YAML, best_yaml(root, header, best))
    write_atomic(root / SWEEP_MD, sweep_markdown(root, header, rows, best, repeats, repeat_values, few))
    if rows or repeat_values:
        from finetune.sweep_plot import save_sweep_figure

        save_sweep_figure(root / SWEEP_PNG, header, rows, best, repeats, repeat_values)
    return few


def write_out_of_fold_predictions(root: Path, folds: Repeats) -> Optional[Path]:
    """Each fold's model's predictions on the rows it was held out from, in ``<root>/folds/predictions.csv``
    (:mod:`finetune.out_of_fold`); ``None`` while a fold's model is missing."""
    from finetune.out_of_fold import write_out_of_fold

    return write_out_of_fold(root / folds.name, {fold: root / folds.folder(fold) for fold in folds.values})


def trials_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    columns = list(dict.fromkeys(key for row in rows for key in row))
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def best_yaml(root: Path, header: Header, best: dict[str, Any]) -> str:
    """The best trial's whole config, writing to ``<sweep>/best`` so that training it starts a new run.

    Made from the config and the trial's values, not read from the trial's folder: with workers on several
    machines, the best trial may have run on another.
    """
    config = config_of(header, best).to_dict()
    config["output"]["output_dir"] = str(root / BEST_DIR)
    config["output"]["resume_from"] = "auto"
    head = (f"# The best trial of the sweep in {root}: trial {best['trial']}, value {best['value']:.4f}.\n"
            f"# Train it from the folder the sweep was started in: finetune train --config {root / BEST_YAML}\n")
    return head + yaml.safe_dump(config, sort_keys=False)


def short(value: Any) -> str:
    """A value for a table: floats to 4 significant digits (trials.csv and best.yaml keep them whole)."""
    return f"{value:.4g}" if isinstance(value, float) else render(value)


def mean_and_deviation(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one run)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def config_of(header: Header, best: Optional[dict[str, Any]]):
    """The config the best trial ran (without a search: the sweep's config)."""
    from finetune.config import load_config

    params = {key: best[key] for key in header.space.keys()} if best is not None else {}
    return load_config(header.config, [*header.overrides, *overrides(params)])


def predict_command(root: Path, header: Header, best: dict[str, Any]) -> str:
    """The command that classifies with the best trial's model in ``root``, in Markdown: on a text, or for a model
    of pairs on a file of them (the command reads pairs from a file alone) with the run's two columns."""
    data, folder = config_of(header, best).data, str(root / best["folder"])
    if data.text_pair_column is None:
        return f"`{shlex.join(['finetune', 'predict', folder, 'a text'])}`"
    return (f"`{shlex.join(['finetune', 'predict', folder, '--file', 'pairs.csv'])}` (a file with the columns "
            f"`{data.text_column}` and `{data.text_pair_column}`)")


def train_on_every_row(root: Path, header: Header, best: Optional[dict[str, Any]]) -> str:
    """The command that trains the best config (without a search: the sweep's config) on all its rows, into
    ``<root>/best`` (best.yaml's folder) or ``<root>/all-rows``. It resets the evaluation keys that need validation
    texts (the sweep's objective among them), which a run on every row would refuse."""
    unset = [f"evaluation.{key}={render(value)}"
             for key, value in config_of(header, best).evaluation.unset_for_no_validation().items()]
    if best is not None:
        return shlex.join(["finetune", "train", "--config", str(root / BEST_YAML), "data.validation_split=0",
                           *unset])
    config = ["--config", header.config] if header.config else []
    return shlex.join(["finetune", "train", *config, *header.overrides, "data.validation_split=0", *unset,
                       f"output.output_dir={root / EVERY_ROW_DIR}"])


def together_against_every_row(root: Path, header: Header, best: Optional[dict[str, Any]]) -> str:
    """The command that scores the folds' models together against the model of every row (where
    :func:`train_on_every_row`'s command writes it) on a labelled file none of them trained on."""
    every_row = root / (BEST_DIR if best is not None else EVERY_ROW_DIR)
    return shlex.join(["finetune", "score", str(root / "folds"), "--file", held_out_file(header, best), "--against",
                       str(every_row)])


def held_out_file(header: Header, best: Optional[dict[str, Any]]) -> str:
    """The labelled file the commands that score the seeds' or folds' models together name: the sweep's test file
    (``data.test_file``), else one to stand in for the user's."""
    return config_of(header, best).data.test_file or "test.csv"


def trials_table(header: Header, rows: list[dict[str, Any]]) -> list[str]:
    """The trials best first, as a Markdown table: their values, the objective, the saved model's validation loss
    (which decides between equal objectives; not repeated where the objective is the loss), updates, seconds."""
    keys = header.space.keys()
    loss = header.metric != "loss"
    heads = ["trial", "state", *(f"`{k}`" for k in keys), header.metric, *(["validation loss"] if loss else []),
             "updates", "s"]
    lines = ["| " + " | ".join(heads) + " |", "| ---: | --- | " + " | ".join("---:" for _ in heads[2:]) + " |"]
    ordered = sorted(rows, key=lambda r: ranking(r["value"], r["eval_loss"], header.greater_is_better))
    for r in ordered:
        cells = [r["trial"], r["state"], *(short(r.get(k)) for k in keys), _four_places(r["value"]),
                 *([_four_places(r["eval_loss"])] if loss else []), "" if r["updates"] is None else r["updates"],
                 f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def _four_places(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"


def tie_broken(metric: str, best: dict[str, Any]) -> str:
    """How the best trial was chosen among trials of the same value, as a sentence after the best one's; ``""``
    where it had none."""
    if not best.get("tied"):
        return ""
    others = " and ".join(", ".join(str(n) for n in best["tied"]).rsplit(", ", 1))
    trials = f"trial{'s' if len(best['tied']) > 1 else ''} {others}"
    if best.get("eval_loss") is None:
        return f" Tied on {metric} with {trials}: the first drawn of them."
    return (f" Tied on {metric} with {trials}: of them, its saved model has the lowest validation loss "
            f"({best['eval_loss']:.4f}).")


def within_the_best(root: Path, header: Header, rows: list[dict[str, Any]], best: dict[str, Any]) -> list[str]:
    """The best trial's 95% interval of the objective over its validation texts, and the trials whose values it
    holds: those its validation data cannot tell from the best. Nothing where the trial's folder is on another
    worker, or the objective has no interval (finetune.metrics.intervals)."""
    from finetune.metrics import POINT_INTERVAL

    metrics = root / best["folder"] / METRICS_FILE
    if not metrics.is_file():
        return []
    summary = json.loads(metrics.read_text(encoding="utf-8"))
    interval = (summary.get("eval_intervals") or {}).get(header.metric)
    if interval is None:
        return []
    low, high = interval
    inside = [r["trial"] for r in rows if r["value"] is not None and r["trial"] != best["trial"]
              and low <= r["value"] <= high]
    several = len(inside) > 1
    which = (f"trial{'s' if several else ''} {', '.join(map(str, inside))} of the others {'lie' if several else 'lies'} "
             f"inside it: this validation data cannot tell {'them' if several else 'it'} from the best") if inside \
        else "no other trial's value lies inside it"
    texts = summary.get("eval", {}).get("num_samples")
    point = f" {POINT_INTERVAL}" if low == high else ""
    return [f"Its {header.metric}'s 95% bootstrap interval over its {texts} validation texts is {low:.4f} to "
            f"{high:.4f}; {which}.{point}"]


def scores_on_the_test_set(root: Path, repeats: Repeats, repeat_values: list[tuple[int, float]], metric: str
                           ) -> Optional[tuple[str, list[float]]]:
    """The test set's name and each seed's or fold's run's score of ``metric`` on it (``data.test_file``: each
    run's ``metrics.json`` holds them); None unless every run's folder here holds one, of the same test set (a
    search leaves it out; runs of workers on other machines are in their folders)."""
    found = []
    for value, _ in repeat_values:
        try:
            test = json.loads((root / repeats.folder(value) / METRICS_FILE).read_text(encoding="utf-8"))["test"]
            found.append((test["file"], float(test["metrics"][metric])))
        except (OSError, ValueError, KeyError, TypeError):
            return None
    names = {name for name, _ in found}
    return (names.pop(), [score for _, score in found]) if len(names) == 1 else None


def sweep_markdown(root: Path, header: Header, rows: list[dict[str, Any]], best: Optional[dict[str, Any]],
                   repeats: Optional[Repeats], repeat_values: list[tuple[int, float]],
                   few_updates: Optional[str] = None) -> str:
    direction = "higher" if header.greater_is_better else "lower"
    lines = ["# Sweep", "", f"`{header.command}`", "",
             "The commands below run from the folder this sweep was started in, where its paths were given.", "",
             f"- objective: `{header.metric}` of each trial's saved model ({direction} is better)",
             f"- space: {header.space.describe()}"]
    if header.space.dimensions:  # without a space nothing is drawn or pruned
        lines.append(f"- sampler: {header.sampler}; pruner: {header.pruner}")
    lines += [f"- storage: {header.storage}", ""]
    if rows:
        counts = {state: sum(r["state"] == state for r in rows) for state in dict.fromkeys(r["state"] for r in rows)}
        done = ", ".join(f"{n} {state}" for state, n in counts.items())
        lines += [f"{len(rows)} of {header.trials} trials: {done}.", "", *trials_table(header, rows), ""]
        lines += [f"{few_updates}.", ""] if few_updates else []
    if best is not None:
        values = ", ".join(f"`{k}={short(best.get(k))}`" for k in header.space.keys())
        lines += [f"Best: trial {best['trial']} ({best['folder']}), {header.metric} {best['value']:.4f}: {values}."
                  + tie_broken(header.metric, best),
                  *within_the_best(root, header, rows, best),
                  f"Its model is in its folder (on the worker that ran it): {predict_command(root, header, best)}. "
                  f"Train it again: `{shlex.join(['finetune', 'train', '--config', str(root / BEST_YAML)])}` (it "
                  f"writes to `{root / BEST_DIR}`).", ""]
    if repeat_values:
        mean, std = mean_and_deviation([v for _, v in repeat_values])
        lines += [f"## Over {len(repeat_values)} {repeats.name}", "",
                  f"{header.metric}: mean {mean:.4f}, standard deviation {std:.4f}", ""]
        if repeats.name == "seeds" and header.space.dimensions:
            seeds = (f"Seeds {repeats.values[0]} to {repeats.values[-1]}, none" if len(repeats.values) > 1
                     else f"Seed {repeats.values[0]}, not one")
            lines += [f"{seeds} that the search trained with: the config was chosen for its score on those, which is "
                      "partly their luck.", ""]
        if repeats.name == "seeds" and len(repeat_values) > 1:
            seeds = str(root / "seeds")
            lines += [f"The {len(repeat_values)} seeds' models predict together, their outputs averaged: "
                      f"`{shlex.join(['finetune', 'predict', seeds, '--file', 'texts.csv'])}`; "
                      f"`{shlex.join(['finetune', 'score', seeds, '--file', held_out_file(header, best)])}` scores "
                      "their mean beside each model alone on texts none of them trained on "
                      "(docs/inference.md#several-models-as-one).", ""]
        if repeats.name == "folds":
            lines += [f"Each fold's run validates on the rows the others train on, so the mean is over all the "
                      f"data once (`{repeats.fixed[0]}`). Once every fold has finished, `folds/predictions.csv` "
                      "holds the out-of-fold predictions: each row by the fold's model that did not train on it.",
                      "", "The folds estimate how the config does on texts it has not seen; the model to keep "
                      f"trains on every row: `{train_on_every_row(root, header, best)}`. Or keep the "
                      f"{len(repeat_values)} folds' models, which predict together, their outputs averaged: "
                      f"`{shlex.join(['finetune', 'predict', str(root / 'folds'), '--file', 'texts.csv'])}`; "
                      f"`{together_against_every_row(root, header, best)}` says on texts none of them trained on "
                      f"whether that pays for {len(repeat_values)} times the compute "
                      "(docs/inference.md#several-models-as-one).", ""]
        tested = scores_on_the_test_set(root, repeats, repeat_values, header.metric)
        if tested is None:
            lines += [f"| {repeats.unit} | {header.metric} |", "| ---: | ---: |"]
            lines += [f"| {value} | {objective:.4f} |" for value, objective in repeat_values]
        else:
            name, scores = tested
            mean, std = mean_and_deviation(scores)
            lines += [f"{header.metric} on the test set {name}, scored once by each run's saved model after "
                      f"training (nothing was chosen on it): mean {mean:.4f}, standard deviation {std:.4f}", "",
                      f"| {repeats.unit} | {header.metric} | test {header.metric} |", "| ---: | ---: | ---: |"]
            lines += [f"| {value} | {objective:.4f} | {score:.4f} |"
                      for (value, objective), score in zip(repeat_values, scores)]
        lines.append("")
    if rows or repeat_values:
        lines += [f"![the objective against each searched value]({SWEEP_PNG})", ""]
    return "\n".join(lines)


def start_line(sweep, metric: str, greater: bool, done: Optional[int]) -> str:
    """What the sweep (a :class:`finetune.sweep.Sweep`) will do, its first line; ``done``: its trials finished
    so far (None: not read, as in a dry run)."""
    parts = [f"sweep in {sweep.output}: objective {metric} ({'higher' if greater else 'lower'} is better)"]
    if sweep.space.dimensions:
        parts.append(f"space {sweep.space.describe()}")
        parts.append(f"{sweep.trials} trial{'s' if sweep.trials != 1 else ''}"
                     f"{f' ({done} done)' if done is not None else ''}, sampler {sweep.sampler}"
                     + (f" (seed {sweep.sampler_seed})" if sweep.sampler_seed is not None else "")
                     + f", pruner {describe_pruner(sweep.pruner)}")
    if sweep.trial_seeds > 1:
        parts.append(f"each trial over {sweep.trial_seeds} seeds")
    what = "the best config" if sweep.space.dimensions else "the config"
    if sweep.seeds:
        parts.append(f"then {what} over {sweep.seeds} seeds")
    if sweep.folds:
        parts.append(f"then {what} on each of {sweep.folds} folds (K-fold cross-validation)")
    parts.append(f"storage {redact(sweep.storage)} (study {sweep.study_name!r})")
    return "; ".join(parts)
