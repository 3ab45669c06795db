"""A test set: read at the start of a run, scored once by the saved model after training.

The validation data is chosen on: the best model, early stopping and thresholds are picked by their scores there,
which therefore lean high. A test set (``data.test_file``, or a data set's ``data.test_split_name``) is only
measured, once, when nothing is left to choose, by the model the run saved, as ``finetune score`` would measure it
on the same rows (:func:`finetune.score.score_texts`: the same metrics, intervals and each label's scores, in the
run's precision, at the saved model's thresholds).

It is read with the training data, before the first update, so that a test file the run cannot read (a missing
column, a label the training data lacks) stops the run before it trains rather than after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("finetune")


@dataclass
class TestSet:
    """The labelled rows of a run's test set, as read at its start."""

    __test__ = False  # not a test class, to pytest

    # as the log, metrics.json and the model card name it: the file's name, or the data set's split (glue/sst2[test])
    name: str
    texts: list
    # the second texts of sentence pairs, or None
    pairs: Optional[list]
    # class ids (single_label), 0/1 vectors (multi_label) or numbers (regression)
    references: list
    # rows whose text (with its pair) a training row has too: their scores are memory, not generalisation
    seen_in_training: int = 0

    def describe(self) -> str:
        """For the start line: ``test: 500 rows of test.csv, scored after training, 3 of them a text also in
        train``."""
        seen = f", {self.seen_in_training} of them a text also in train" if self.seen_in_training else ""
        return f"test: {len(self.texts)} rows of {self.name}, scored after training{seen}"


def as_test_set(read, cfg, train_split) -> Optional[TestSet]:
    """The run's test set from what :func:`finetune.data.load_test_split` read (``None``: none), its rows counted
    against ``train_split``'s texts."""
    from finetune.data import labelled_columns, rows_seen_in
    from finetune.resources import file_name

    if read is None:
        return None
    split, source = read
    name = file_name(source) if cfg.data.test_file is not None else source
    return TestSet(name, *labelled_columns(split), rows_seen_in(train_split, split))


def score_test_set(run, output_dir: str | Path) -> Optional[dict[str, Any]]:
    """The saved model in ``output_dir`` on the test set of ``run`` (a :class:`~finetune.run.Run`), as
    ``finetune score --json`` reports a file (:meth:`finetune.score.Score.to_dict`), said in a line of the log with
    what is worth a warning in it; on the main process, ``None`` on the others.

    The model is loaded from what the run saved (a LoRA run's merged model), in the run's precision and
    evaluation batch size, and predicts at its saved thresholds; the metrics are the validation's. Every process
    runs a share of the batches one process would run (:meth:`~finetune.predictor.Predictor.share_of_logits`), so
    the scores are one process's, and none of them waits for another to score it all. The trained model stays
    where it is, so the copy may not fit beside it (a large model under LoRA, whose base weights training did not
    double): then a warning says how to score it in a process of its own, and the run's other outputs are written
    without it.
    """
    from finetune.errors import is_out_of_memory
    from finetune.predictor import Predictor
    from finetune.score import cautions, score_logits
    from finetune.shares import logits_in_order, shares_of_every_process

    acc = run.accelerator
    test, precision = run.test, str(acc.mixed_precision)
    processes = (acc.process_index, acc.num_processes)
    predictor = None
    try:
        predictor = Predictor.load(output_dir, batch_size=run.cfg.training.per_device_eval_batch_size,
                                   precision=precision)
        # every test text tokenized by each process (no lengths shared): the one collective is after this, where a
        # process that ran out of memory loading the model or predicting still meets the others
        share = predictor.share_of_logits(test.texts, test.pairs, processes,
                                          progress=run.cfg.logging.progress_bar and acc.is_main_process)
    except Exception as exc:  # noqa: BLE001 - running out of memory alone is told here
        if not is_out_of_memory(exc):
            raise
        share = str(acc.device)  # where it ran out, for the warning
    shares = shares_of_every_process(share, processes, to=0)
    result = None
    if acc.is_main_process:
        short = [part for part in shares if isinstance(part, str)]
        if short:
            logger.warning(not_scored(run, output_dir, precision, short))
        else:
            logits = logits_in_order(shares, len(test.texts), len(predictor.labels))
            score = score_logits(predictor, run.metrics, test.name, test.texts, test.pairs, test.references, logits,
                                 seen=test.seen_in_training)
            result = score.to_dict()
            logger.info(scores_said(result))
            for caution in cautions(score, f"test texts of {test.name}"):
                logger.warning(caution)
    del predictor  # the saved model's copy, before the others go on
    acc.wait_for_everyone()
    return result


def not_scored(run, output_dir: str | Path, precision: str, devices: list[str]) -> str:
    """The warning for a test set that did not fit beside the trained model, with the command that scores it."""
    file = run.cfg.data.test_file
    command = (f"finetune score {output_dir} --file {file}" + (f" --precision {precision}" if precision != "no" else "")
               if file is not None else f"finetune score {output_dir} --file <{run.test.name} saved as a file>")
    return (f"the test set {run.test.name} was not scored: out of memory on {', '.join(devices)} with the saved "
            f"model beside the trained one; the run's other outputs are written without its scores. Score it in a "
            f"process of its own: {command}")


def scores_said(scores: dict[str, Any]) -> str:
    """The log's line of the test scores: ``test on test.csv (500 texts): loss=0.0411 accuracy=0.9900
    (0.9820-0.9960) ...``."""
    from finetune.metrics import scores_in_a_line

    seen = scores.get("seen_in_training")
    trained = f", {seen} of them texts the model trained on" if seen else ""
    intervals = scores.get("intervals") or {}
    return (f"test on {scores['file']} ({scores['metrics']['num_samples']} texts{trained}): "
            f"{scores_in_a_line(scores['metrics'], intervals)}"
            + (" (95% bootstrap intervals over the test texts)" if intervals else ""))
