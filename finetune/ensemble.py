"""Several runs' models predicting as one: ``finetune predict`` and ``finetune score`` of a folder of runs.

A sweep's ``folds/`` holds K models, each trained without one fold of the training data, and its ``seeds/`` as
many trained with other seeds. Given such a folder (any folder whose sub-folders hold saved models), the commands
run each model in turn, one in memory at a time, each cutting and padding the texts as its own run did, and average
what they say of each text: its probabilities (of each class, or of each label), or a regression's number. Averaged
probabilities, not logits: each model's say is bounded, so one overconfident model cannot outvote the rest.

The ensemble decides as one model would, at thresholds: a label's is the mean of the models' own (each chosen on
that model's validation texts, ``evaluation.threshold: per_label``; 0.5, or the most probable of two classes, for a
model that kept none), unless a threshold is given.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Optional, Sequence

from finetune.errors import ConfigError, ModelError, is_main_rank
from finetune.out_of_fold import OUT_OF_FOLD_FILE
from finetune.outputs import CONFIG_FILE, refuse_a_run_file, require_saved_model, saved_config
from finetune.prediction_rows import PredictionRows, probabilities_of_logits
from finetune.predictor import DEFAULT_BATCH_SIZE, Predictor
from finetune.precisions import resolved_precision
from finetune.schema import DEFAULT_THRESHOLD
from finetune.shares import device_of, launched_processes

logger = logging.getLogger("finetune")


def saved_runs(path: str | Path, flag: Optional[str] = None) -> list[Path]:
    """The runs whose models ``path`` stands for: itself, where it holds a model; else each of its sub-folders
    that holds one (a sweep's ``folds/`` or ``seeds/``).

    Raises:
        ModelError: where it holds neither (:func:`finetune.outputs.require_saved_model`'s line, ``flag`` first).
    """
    runs = [sub for sub in sub_folders(path) if (sub / "config.json").is_file()]
    return runs or [require_saved_model(path, flag)]


def runs_without_a_model(path: str | Path) -> list[str]:
    """The sub-folders of a folder of runs that hold a run (its ``config.yaml``) but no saved model: a run still
    training, or one stopped before its end, which :func:`saved_runs` leaves out."""
    return [sub.name for sub in sub_folders(path)
            if (sub / CONFIG_FILE).is_file() and not (sub / "config.json").is_file()]


def sub_folders(path: str | Path) -> list[Path]:
    """The folders in ``path`` in their names' natural order (``fold-2`` before ``fold-10``); none where ``path``
    holds a model itself (a run's folder: its ``checkpoints/`` are not a folder of runs) or is no folder."""
    path = Path(path)
    if (path / "config.json").is_file() or not path.is_dir():
        return []
    return sorted((sub for sub in path.iterdir() if sub.is_dir()),
                  key=lambda sub: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", sub.name)])


def load_predictor(path: str | Path, *, flag: Optional[str] = None, notes: bool = True, **options):
    """A :class:`~finetune.predictor.Predictor` of the run in ``path``, or an :class:`Ensemble` of the runs in a
    folder of them (:func:`saved_runs`), warning of the runs there that have no model yet, and (``notes``) saying
    where it predicts (:func:`say_where_it_predicts`). ``options``: :meth:`Predictor.load`'s."""
    runs = saved_runs(path, flag)
    unfinished = runs_without_a_model(path)
    if unfinished and is_main_rank():  # a fold still training would else leave the mean short of a model unsaid
        logger.warning("%s: %s hold%s a run with no saved model yet (still training, or stopped before its end), "
                       "left out: %d of %d runs predict", path, ", ".join(unfinished),
                       "s" if len(unfinished) == 1 else "", len(runs), len(runs) + len(unfinished))
    predictor = Predictor.load(runs[0], **options) if len(runs) == 1 else Ensemble(runs, **options)
    if notes and is_main_rank():
        say_where_it_predicts(len(runs), options)
    return predictor


def say_where_it_predicts(models: int, options: dict) -> None:
    """What ``auto`` precision chose, and NVIDIA GPUs left idle by a torch that cannot reach them where the device
    was chosen as training chooses it: a large file predicted many times slower than the GPU would, unsaid."""
    from finetune.gpu_reach import unreached_gpus
    from finetune.precisions import choose_precision

    device = device_of(options.get("device"))
    if options.get("precision") == "auto":
        logger.info("precision %s (%s)", *choose_precision("auto", device))
    if options.get("device") is None:
        doing = "the model predicts" if models == 1 else f"the {models} models predict"
        said = unreached_gpus(device, doing, "predicts")
        if said:
            logger.warning(said)


def refuse_the_runs_files(path: str | Path, runs: Sequence[Path], flag: str) -> None:
    """Refuse ``path`` as a command's output where it is a file of one of ``runs``
    (:func:`finetune.outputs.refuse_a_run_file`), or, beside several, the file a sweep writes its folds' out-of-fold
    predictions to.

    Raises:
        ConfigError: naming the flag and the file.
    """
    for run in runs:
        refuse_a_run_file(path, run, flag)
    if len(runs) > 1 and Path(path).resolve() == (runs[0].parent / OUT_OF_FOLD_FILE).resolve():
        raise ConfigError(f"{flag} {path}: is where a sweep writes its folds' out-of-fold predictions; name another "
                          f"file")


class Ensemble(PredictionRows):
    """Saved models that predict as one: a text's probabilities are the mean of theirs, a regression's number the
    mean of their numbers. It offers what :class:`~finetune.predictor.Predictor` offers a command (``logits``,
    ``probabilities``, ``predict``, ``task``), so that predicting and scoring take either.

    Args:
        runs: The runs' folders (a run's ``output_dir`` each, or any folder a model was saved to). Their models
            must have the same labels, in the same order, and the same problem type, and all read text pairs or
            none.
        device, batch_size, precision, across_processes: as :meth:`Predictor.load` takes them, for each model
            (``precision="auto"`` chosen once, for all of them).
        threshold: As :class:`~finetune.predictor.Predictor` takes it; ``None``: the mean of the models' own.

    Raises:
        ModelError: naming the first run whose model differs from the first run's, or one that cannot load.
    """

    def __init__(self, runs: Sequence[str | Path], *, device=None, batch_size: int = DEFAULT_BATCH_SIZE,
                 threshold=None, precision: str = "no", across_processes: bool = False):
        from finetune.tasks import label_names, problem_type_of, saved_model_config

        if not runs:
            raise ValueError("an ensemble needs at least one run")
        self.runs = [Path(run) for run in runs]
        configs = [saved_model_config(run) for run in self.runs]
        self.labels, self.problem_type = label_names(configs[0]), problem_type_of(configs[0])
        check_alike(self.runs, configs)
        first = saved_config(self.runs[0])
        self.positive_label = first.evaluation.positive_label if first is not None else None
        self.decision_config = with_mean_thresholds(configs, self.labels, self.problem_type)
        self.task = self.task_at(threshold)
        # auto's choice (each model chooses alike), which a score records
        self.precision = resolved_precision(precision, device_of(device))
        self.processes = launched_processes() if across_processes else (0, 1)
        if self.processes[0] == 0:
            logger.info("%d models, their %s averaged: %s", len(self.runs),
                        "numbers" if self.problem_type == "regression" else "probabilities", said_runs(self.runs))
        # each model's logits of the texts the last prediction ran, and its decisions at its own thresholds: what
        # a score of each model alone reads (finetune.score.models_alone)
        self.alone: list[tuple[Path, "np.ndarray", "Task"]] = []  # noqa: F821
        self.member_options = {"device": device, "batch_size": batch_size, "precision": self.precision,
                               "across_processes": across_processes}

    def mean_outputs(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
                     progress: bool = False) -> "np.ndarray":  # noqa: F821
        """The models' mean probabilities (a regression's mean numbers), a float32 row per text in input order:
        each model loaded, run on every text and let go before the next, so one is in memory at a time."""
        import numpy as np

        total, self.alone, kind = None, [], self.problem_type
        for number, run in enumerate(self.runs, 1):
            member = Predictor.load(run, **self.member_options)
            member.progress_name = f"predict {number}/{len(self.runs)}"
            logits = member.logits(texts, text_pairs, progress)
            self.alone.append((run, logits, member.task))
            outputs = logits if kind == "regression" else probabilities_of_logits(logits, kind)
            total = outputs.astype(np.float64) if total is None else total + outputs
            del member  # its weights freed before the next model's are read
        return (total / len(self.runs)).astype(np.float32)

    def probabilities(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
                      progress: bool = False) -> "np.ndarray":  # noqa: F821
        """The models' mean label probabilities, columns in label-id order (``self.labels``).

        Raises:
            ValueError: for regression models (their outputs are numbers: use :meth:`logits`).
        """
        if self.problem_type == "regression":
            raise ValueError("regression models predict numbers, not probabilities: use logits()")
        return self.mean_outputs(texts, text_pairs, progress)

    def logits(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
               progress: bool = False) -> "np.ndarray":  # noqa: F821
        """Float32 logits whose probabilities are the models' mean ones (their logarithms; a multi-label
        model's log-odds), or regression models' mean numbers: what a score's loss and metrics read as one
        model's logits."""
        return logits_of_probabilities(self.mean_outputs(texts, text_pairs, progress), self.problem_type)


def said_runs(runs: Sequence[Path]) -> str:
    """The runs' folders in a line: their names in the folder that holds them all, else each folder."""
    folders = {run.parent for run in runs}
    if len(folders) == 1:
        return f"{', '.join(run.name for run in runs)} in {folders.pop()}"
    return ", ".join(map(str, runs))


def logits_of_probabilities(probabilities: "np.ndarray", problem_type: str) -> "np.ndarray":  # noqa: F821
    """Float32 logits whose softmax (single label) or sigmoids (multi-label) are ``probabilities``; a regression's
    numbers as they are. A probability of 0 or 1 is taken as the nearest float32 can tell from it, so that a loss
    of these logits stays finite."""
    import numpy as np

    if problem_type == "regression":
        return probabilities
    p = np.clip(probabilities.astype(np.float64), np.finfo(np.float32).tiny, 1.0)
    if problem_type == "multi_label":
        p = np.minimum(p, 1.0 - np.finfo(np.float32).epsneg)
        return (np.log(p) - np.log1p(-p)).astype(np.float32)
    return np.log(p).astype(np.float32)


def check_alike(runs: Sequence[Path], configs: Sequence) -> None:
    """Refuse models that answer different questions: other labels, or their order, another problem type, text
    pairs where the first takes single texts (or the other way round).

    Raises:
        ModelError: naming the first run that differs from the first, and how.
    """
    from finetune.tasks import label_names, problem_type_of

    labels, problem_type = label_names(configs[0]), problem_type_of(configs[0])
    pairs = takes_pairs(runs[0])
    for run, config in zip(runs[1:], configs[1:]):
        if problem_type_of(config) != problem_type:
            differs = f"a {problem_type_of(config)} model, where {runs[0]} holds a {problem_type} one"
        elif label_names(config) != labels:
            differs = f"labels {', '.join(label_names(config))}, where {runs[0]} has {', '.join(labels)}"
        elif takes_pairs(run) != pairs:
            kinds = ("single texts", "text pairs")
            differs = f"a model of {kinds[not pairs]}, where {runs[0]} holds one of {kinds[pairs]}"
        else:
            continue
        raise ModelError(f"{run}: {differs}; the models of an ensemble must answer the same question")


def takes_pairs(run: Path) -> bool:
    """Whether the run in ``run`` trained on text pairs (its saved ``config.yaml``; no config: single texts)."""
    cfg = saved_config(run)
    return cfg is not None and cfg.data.text_pair_column is not None


def with_mean_thresholds(configs: Sequence, labels: Sequence[str], problem_type: str):
    """The first model's config (its labels) with thresholds that are the mean of every model's own: a
    multi-label model's each label's (0.5 where a model kept none); a two-class model's, on the positive class
    the first model that kept one names (0.5 where a model kept none; one kept on the other class counted from
    that class's side). None kept by any: none, so the ensemble predicts as its models do without."""
    from statistics import fmean

    from finetune.tasks import CONFIG_THRESHOLDS, model_thresholds, positive_threshold

    config = copy.deepcopy(configs[0])
    mean = None
    if problem_type == "multi_label":
        kept = [model_thresholds(c, labels) for c in configs]
        if any(own is not None for own in kept):
            rows = [own or (DEFAULT_THRESHOLD,) * len(labels) for own in kept]
            mean = {name: fmean(column) for name, column in zip(labels, zip(*rows))}
    elif problem_type == "single_label":
        kept = [positive_threshold(c) for c in configs]
        positive = next((own[0] for own in kept if own is not None), None)
        if positive is not None:
            # a model predicting the other class over t predicts this one over 1 - t
            mean = {labels[positive]: fmean(DEFAULT_THRESHOLD if own is None else own[1] if own[0] == positive
                                            else 1.0 - own[1] for own in kept)}
    setattr(config, CONFIG_THRESHOLDS, mean)
    return config
