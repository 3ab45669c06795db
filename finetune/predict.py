"""Classify texts with a fine-tuned model: ``python -m finetune.predict``.

Usage::

    python -m finetune.predict outputs/sms_spam "WIN a free prize, call now" "see you at lunch"
    python -m finetune.predict outputs/sms_spam --file messages.txt --output predictions.csv
    accelerate launch --multi_gpu --num_processes 8 -m finetune.predict outputs/sms_spam --file big.csv --output p.csv

Each prediction has the label (the most probable class; for two classes, the positive class where its probability is
over a threshold: the model's, or ``--threshold``), its probability (``score``) and every class's; for a multi-label
model, ``labels`` (every label whose sigmoid probability is over its threshold: the model's, or ``--threshold``) and
each label's probability; for a regression model, the number (``score``). Texts given on the command line print as
JSON lines; ``--file`` reads what training reads (and ``.txt``, a text per line unless its lines split on tabs alike,
as a table's; ``-``, standard input) and writes one row per input row, in order, its columns kept and the prediction
added (docs/inference.md). The model runs where training would (a GPU if there is one), in float32 unless
``--precision`` asks for autocast, on batches of similar length, each text cut and padded as the run did (its saved
``config.yaml``). The same folder works in plain ``transformers.pipeline("text-classification", model=output_dir)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from finetune.errors import (PROGRESS_SECONDS_IN_A_FILE, CommandParser, ConfigError, ModelError, OutOfMemory,
                             notes_to_stderr, out_of_memory_told_as, redraws_in_place, run_command)
from finetune.outputs import refuse_a_run_file, saved_config
from finetune.precisions import add_precision_argument, autocast_dtype, check_precision
from finetune.prediction_files import (STDIN, check_options, file_kind, local_file, note_the_files_own_columns,
                                       predict_rows, prediction_prefix, read_rows, ONE_TEXT_EACH, TEXT_FOLDER)
from finetune.prediction_output import output_separator, predictions_summary, print_predictions, write_predictions
from finetune.schema import PAD_TO_MULTIPLE_OF  # the schema alone: no YAML or config loaded
from finetune.shares import (batches_of_share, launched_processes, lengths_across_processes, logits_in_order,
                             process_device, shares_of_every_process)
from finetune.truncation import (Truncation, collator_arguments, cut_of, model_features, padding_for,
                                 prediction_length)

DEFAULT_BATCH_SIZE = 64


class Predictor:
    """Batched predictions of a sequence-classification model, for its problem type.

    ``transformers.pipeline("text-classification")`` gives the same numbers (tested); this runs the texts
    longest first, so a file of mixed lengths pads far less, and returns arrays for the metrics. A run's own
    cut and padding: :meth:`load` (a saved run) and :meth:`of_run` (one in memory) read them.

    Args:
        model: A ``*ForSequenceClassification`` model whose config has ``id2label``.
        tokenizer: Its tokenizer.
        device: Where to run; ``None`` keeps the model where it is.
        batch_size: Texts per forward pass.
        max_length: Truncate inputs to this many tokens (``None``: the tokenizer's and the model's limits).
        truncation: What a longer text keeps: ``head``, ``tail``, ``head_tail`` or ``chunks``
            (``data.truncation``; under ``chunks`` a text's output is the mean of its windows' logits).
        head_tokens: ``head_tail``: the text's tokens kept from its start (``data.head_tokens``).
        stride: ``chunks``: the tokens each window shares with the one before (``data.stride``).
        threshold: The probability over which a label is predicted: a multi-label model's (one number, one
            per label, or ``{label name: threshold}`` for some, the rest at the model's own), or a two-class
            model's positive class's (else the other class is; by name, ``{ham: 0.9}``, on the class named);
            ``None``: those the model's config carries (``label_thresholds``), else 0.5 for every label of a
            multi-label model and the most probable class for a single-label one.
        precision: The forward passes' arithmetic, as ``training.mixed_precision`` names it: ``no`` (float32),
            ``bf16`` or ``fp16`` (autocast; fp16 on a CUDA GPU only). Logits come back in float32 either way.
        pad_to_multiple_of: Pad a batch to a multiple of this many tokens (``None``: its longest text's), as
            the run padded its micro-batches (``data.pad_to_multiple_of``, whose default this is).
        padding: ``data.padding``: ``auto`` pads every batch to ``max_length`` for a model whose output reads the
            padding (:func:`finetune.truncation.padding_for`), so that no text's prediction depends on the others.
        positive_label: The class a ``threshold`` given to a two-class model decides on, where its config
            names none (``evaluation.positive_label``; ``None``: the second class).
        across_processes: Under ``accelerate launch``, where every process passes the same texts: each runs
            a share of the batches (:meth:`share_of_logits`) and every process gets all the rows back.
        num_workers: DataLoader workers that pad the next batches while the model runs (``auto``: as
            ``data.num_workers`` decides, up to 4 on a GPU and none on a CPU; never more than the batches less one).
    """

    def __init__(self, model, tokenizer, *, device=None, batch_size: int = DEFAULT_BATCH_SIZE,
                 max_length: Optional[int] = None, threshold=None, truncation: str = "head",
                 head_tokens: Optional[int] = None, stride: Optional[int] = None, precision: str = "no",
                 pad_to_multiple_of: Optional[int] = PAD_TO_MULTIPLE_OF, positive_label: Optional[str] = None,
                 padding: str = "auto", across_processes: bool = False, num_workers: int | str = "auto"):
        import torch

        from finetune.tasks import compute_output_in_float32, label_names, problem_type_of

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.autocast = autocast_dtype(precision, self.device)
        self.precision = precision
        if device is not None:
            self.model.to(self.device)
        self.batch_size = batch_size
        self.max_length = prediction_length(model.config, tokenizer, max_length)
        self.truncation = Truncation(truncation, self.max_length, head_tokens, stride) if self.max_length else None
        self.labels = label_names(model.config)
        self.problem_type = problem_type_of(model.config)
        compute_output_in_float32(self.model)  # a regression model's prediction, as training's: not rounded to bf16
        self.positive_label = positive_label
        self.task = self.task_at(threshold)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padded_to = padding_for(padding, self.max_length, model.config).length
        # (this process's index, the number sharing the batches)
        self.processes = launched_processes() if across_processes else (0, 1)
        self.num_workers = num_workers

    @classmethod
    def load(cls, output_dir: str | os.PathLike, *, device=None, batch_size: int = DEFAULT_BATCH_SIZE,
             max_length: Optional[int] = None, threshold=None, precision: str = "no",
             across_processes: bool = False) -> "Predictor":
        """Load the model and tokenizer that a run saved in ``output_dir``.

        Args:
            output_dir: A run's ``output.output_dir``, one of its checkpoints (a
                LoRA run's too), or any directory ``AutoModelForSequenceClassification`` can load.
            device: ``None`` picks the device as training does (Accelerate's
                ``PartialState``: GPU if available, else CPU, using all cores).
            batch_size: Texts per forward pass.
            max_length: Truncation length; ``None``: ``data.max_length`` of the run's ``config.yaml``, if any.
            precision: ``no`` (float32), ``bf16`` or ``fp16`` (see the class).
            across_processes: Share the batches among the processes launched (see the class).

        Raises:
            ModelError: if ``output_dir`` holds no loadable model.
            ConfigError: if its ``config.yaml`` is invalid.
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from finetune.lora import is_adapter_checkpoint, load_adapter_checkpoint
        from finetune.outputs import require_saved_model

        path = require_saved_model(output_dir)
        cfg = saved_config(path)
        if max_length is None:
            max_length = cfg.data.max_length if cfg is not None else None
        cut = cut_of(cfg.data) if cfg is not None else {}
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            if is_adapter_checkpoint(path):  # a LoRA run's checkpoint: its base model plus adapter/, merged
                model = load_adapter_checkpoint(path)
            else:
                model = AutoModelForSequenceClassification.from_pretrained(path)
        except (OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(f"{path}: cannot load the model: {first}") from None
        model.eval()
        if device is None:
            device = process_device()
        positive = cfg.evaluation.positive_label if cfg is not None else None  # what a run scored F1 on
        return cls(model, tokenizer, device=device, batch_size=batch_size, max_length=max_length,
                   threshold=threshold, precision=precision, positive_label=positive,
                   across_processes=across_processes, **cut)

    @classmethod
    def of_run(cls, run, **options) -> "Predictor":
        """The model of a run built by ``setup_run`` (a notebook's), where it is, cutting and padding texts as
        the run does: what :meth:`load` gives once the run is saved. ``options``: the class's other arguments."""
        data = run.cfg.data
        return cls(run.accelerator.unwrap_model(run.model), run.tokenizer,
                   **{"max_length": data.max_length, **cut_of(data),
                      "positive_label": run.cfg.evaluation.positive_label, **options})

    def task_at(self, threshold=None):
        """The model's :class:`~finetune.tasks.Task`, predicting at ``threshold`` (see the class); ``None``: at
        its own thresholds (:func:`finetune.tasks.decision_task`).

        Raises:
            ConfigError: for a threshold where none applies (regression, more than two classes): said, not ignored.
        """
        from finetune.tasks import decision_task

        try:
            return decision_task(self.model.config, threshold, self.positive_label)
        except ValueError as exc:
            raise ConfigError(f"threshold {threshold}: {exc}") from None

    def logits(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
               progress: bool = False) -> "np.ndarray":  # noqa: F821
        """Float32 logits, one row per text, in input order (computed in the predictor's ``precision``).

        Texts are tokenized once, then run longest first in batches of ``batch_size`` so each batch pads to
        similar lengths; the rows are put back in input order. Processes that share the batches
        (``across_processes``) each tokenize a slice of the texts for their lengths, then their batches' texts.
        Under ``chunks`` a batch holds ``batch_size`` texts with all their windows, and a text's row is the mean
        of its windows' logits, as in training.

        Args:
            texts: The texts.
            text_pairs: Second texts of sentence pairs (same length), for a model trained on pairs.
            progress: Show a tqdm bar of the texts (redrawn every 30 s into a batch job's log).
        """
        texts = list(texts)
        first = self.processes[0] == 0  # the one bar, of its own share, where processes share the batches
        lengths = None if self.processes[1] == 1 else lengths_across_processes(  # each tokenizes its share alone
            len(texts), lambda rows: self.features_of(texts, text_pairs, rows)[1], self.processes)
        share = self.share_of_logits(texts, text_pairs, self.processes, progress and first, lengths)
        return logits_in_order(shares_of_every_process(share, self.processes), len(texts), len(self.labels))

    def features_of(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]], rows: Sequence[int]
                    ) -> tuple[list[dict[str, list]], list[int]]:
        """The model inputs and token lengths of the texts at ``rows``, cut as the run cut them."""
        pairs = [text_pairs[i] for i in rows] if text_pairs is not None else None
        return model_features(self.tokenizer, self.truncation, [texts[i] for i in rows], pairs)

    def share_of_logits(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]], share: tuple[int, int],
                        progress: bool = False, lengths: Optional[Sequence[int]] = None
                        ) -> tuple["np.ndarray", "np.ndarray"]:  # noqa: F821
        """One of ``n`` processes' part of :meth:`logits`: with ``share = (i, n)``, the batches ``i``, ``i + n``,
        ``i + 2n``, ... of those one process runs, each made and run as one process makes and runs it, as the
        texts' row numbers and their logits. The ``n`` parts put together (:func:`finetune.shares.logits_in_order`)
        are one process's :meth:`logits` bit for bit on devices that compute alike, whatever ``n`` is: no batch is
        cut or padded otherwise. Given every text's ``lengths`` (:func:`finetune.shares.lengths_across_processes`),
        it tokenizes only its batches' texts; else all of them."""
        import numpy as np
        import torch
        from tqdm.auto import tqdm
        from transformers import DataCollatorWithPadding

        from finetune.chunks import ChunkCollator, document_logits, split_batch

        texts = list(texts)
        if text_pairs is not None and len(text_pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(text_pairs)} text pairs")
        rows, values = [np.zeros(0, dtype=np.int64)], [np.zeros((0, len(self.labels)), dtype=np.float32)]
        if not texts:
            return rows[0], values[0]
        features = None
        if lengths is None:  # every text tokenized here
            features, lengths = self.features_of(texts, text_pairs, range(len(texts)))
        batches = batches_of_share(lengths, self.batch_size, share)
        if features is None:  # this share's texts alone
            mine = [row for batch in batches for row in batch]
            features = dict(zip(mine, self.features_of(texts, text_pairs, mine)[0]))
        collate = DataCollatorWithPadding(self.tokenizer, **collator_arguments(self.padded_to, self.pad_to_multiple_of),
                                          return_tensors="pt")
        if self.truncation is not None and self.truncation.chunked:
            collate = ChunkCollator(collate)
        was_training = self.model.training
        self.model.eval()
        total = sum(map(len, batches))
        # into a batch job's log, where each redraw stays, as seldom as the training's progress is written there
        every = 0.1 if redraws_in_place(sys.stderr) else PROGRESS_SECONDS_IN_A_FILE
        with tqdm(total=total, disable=not progress, unit="text", desc="predict", mininterval=every) as bar, \
                torch.inference_mode():
            for batch, collated in zip(batches, self.collated(features, batches, collate)):
                inputs, chunk_rows = split_batch({k: v.to(self.device, non_blocking=True) for k, v in collated.items()})
                with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                    logits = self.model(**inputs).logits
                rows.append(np.asarray(batch, dtype=np.int64))
                values.append(document_logits(logits.float(), chunk_rows).cpu().numpy())
                bar.update(len(batch))
        if was_training:
            self.model.train()
        return np.concatenate(rows), np.concatenate(values)

    def collated(self, features, batches: list[list[int]], collate) -> Iterable[dict[str, Any]]:
        """Each of ``batches`` (row numbers of ``features``) padded by ``collate``, in order: here, or on a GPU by
        DataLoader workers into pinned memory while the model runs the batches before (:meth:`collating_workers`)."""
        workers = self.collating_workers(len(batches))
        if not workers:
            return (collate([features[i] for i in batch]) for batch in batches)
        from torch.utils.data import DataLoader

        return DataLoader(features, batch_sampler=batches, collate_fn=collate, num_workers=workers,
                          pin_memory=self.device.type == "cuda")

    def collating_workers(self, batches: int) -> int:
        """The DataLoader workers that pad ``batches`` batches (the class's ``num_workers``): on a GPU, padding in
        Python is host time the GPU waits for, as in training (docs/performance.md); one batch has none to overlap."""
        from finetune.launch import choose_workers

        return min(choose_workers(self.num_workers, self.device, self.processes[1]), max(0, batches - 1))

    def probabilities(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
                      progress: bool = False) -> "np.ndarray":  # noqa: F821
        """Label probabilities, columns in label-id order (``self.labels``): the softmax of :meth:`logits`
        for a single-label model, each label's sigmoid for a multi-label one.

        Raises:
            ValueError: for a regression model (its outputs are numbers: use :meth:`logits`).
        """
        import numpy as np

        if self.problem_type == "regression":
            raise ValueError("a regression model predicts numbers, not probabilities: use logits()")
        logits = self.logits(texts, text_pairs, progress).astype(np.float64)
        if self.problem_type == "multi_label":
            return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)

    def predict(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
                progress: bool = False) -> list[dict[str, Any]]:
        """One dict per text, in input order.

        * single label: ``{"label", "score", "probabilities": {label: p}}``;
        * multi-label: ``{"labels": [every label with p > its threshold], "probabilities": {label: p}}``;
        * regression: ``{"score": the predicted number}``.
        """
        if self.problem_type == "regression":
            return [{"score": float(row[0])} for row in self.logits(texts, text_pairs, progress)]
        probs = self.probabilities(texts, text_pairs, progress)
        results = []
        for row, decided in zip(probs, self.task.decide(probs)):
            probabilities = {name: float(p) for name, p in zip(self.labels, row)}
            if self.problem_type == "multi_label":
                chosen = [name for name, yes in zip(self.labels, decided) if yes]
                results.append({"labels": chosen, "probabilities": probabilities})
                continue
            label = int(decided)
            results.append({"label": self.labels[label], "score": float(row[label]), "probabilities": probabilities})
        return results

    def empty_prediction(self) -> dict[str, Any]:
        """What an empty text gets, so that output rows still line up with the input."""
        if self.problem_type == "regression":
            return {"score": None}
        probabilities = {name: None for name in self.labels}
        if self.problem_type == "multi_label":
            return {"labels": [], "probabilities": probabilities}
        return {"label": "", "score": None, "probabilities": probabilities}


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="finetune predict", description="Classify texts with a fine-tuned model.")
    parser.add_argument("output_dir", help="a run's output directory (the saved model)")
    parser.add_argument("texts", nargs="*", help="texts to classify (printed as JSON lines)")
    parser.add_argument("--file", default=None, help="classify the texts of a .txt, .csv, .tsv, .json(l), .parquet "
                        "or .xlsx file, a folder of .txt files (a text each) or one datasets saved, on disk, at a URL "
                        "or in a .zip or .tar.gz (contest.zip/test.csv) (-: one text per line from standard input)")
    parser.add_argument("--sheet", default=None, help="the sheet of an .xlsx --file to classify (default: the first)")
    parser.add_argument("--split", metavar="NAME", help="classify one split of the --file alone: the rows whose "
                        "column of splits holds NAME, or a split of a folder datasets saved")
    parser.add_argument("--split-column", metavar="COLUMN", help="the --file's column of splits (default: the "
                        "run's data.split_column)")
    parser.add_argument("--output", help="write the predictions to a .csv, .tsv, .parquet, .xlsx or .jsonl")
    parser.add_argument("--text", "--text-column", dest="text_column", metavar="COLUMN", default=None,
                        help="CSV column / JSON key of the text (default: the run's data.text_column)")
    parser.add_argument("--encoding", default=None, help="text encoding of the --file (cp1252, latin-1, ...; "
                        "default: the run's data.encoding)")
    parser.add_argument("--quoting", choices=("auto", "csv", "none"), help="how a CSV or TSV --file's quotes read "
                        "(default: the run's data.quoting)")
    parser.add_argument("--text-pair", "--text-pair-column", dest="text_pair_column", metavar="COLUMN", default=None,
                        help="column of the second text, for models trained on pairs (default: the run's)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="texts per forward pass")
    parser.add_argument("--threshold", default=None, help="multi-label models: predict every label whose "
                        "probability is over this; two classes: the positive class (the run's "
                        "evaluation.positive_label) where its probability is over this, else the other; or by label "
                        "name: \"{toxic: 0.3, insult: 0.6}\" (default: the model's, evaluation.threshold's, else "
                        "the most probable class)")
    add_precision_argument(parser)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    # intermixed: texts may come before or after the options
    return parser.parse_intermixed_args(argv)


def quiet_progress_bars(files: bool = True) -> None:
    """Silence the bars of loading weights and, with ``files``, of reading one (datasets' import takes a second
    that texts given on the command line do without), for commands that show a bar of their own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if files:
        import datasets
        datasets.disable_progress_bars()


def run(args: argparse.Namespace) -> None:
    """Check every argument, load the model, predict, write. Raises FinetuneError on bad input."""
    check_options(args)
    check_precision(args.precision, "--precision")
    output_dir = Path(args.output_dir)
    # the file last, since a URL's is downloaded first, and an archive unpacked: the copy is what is read
    file = local_file(args.file) if args.file else args.file
    cfg = saved_config(output_dir)
    encoding = args.encoding or (cfg.data.encoding if cfg is not None else "utf-8")
    text_column = args.text_column or (cfg.data.text_column if cfg is not None else "text")
    # a line of a .txt file or standard input, or a folder's file, is a text: the run's text column names a column
    kind = file and (".txt" if file == STDIN else file_kind(file, encoding, text_column, cfg and cfg.data))
    if kind in ONE_TEXT_EACH and args.text_column is not None:
        raise ConfigError(f"--text {args.text_column!r}: names a column; {args.file} holds one text per "
                          f"{'file' if kind == TEXT_FOLDER else 'line'}")
    if args.output:
        if file != STDIN and Path(args.output).resolve() == Path(file).resolve():
            raise ConfigError(f"--output {args.output}: is the --file being classified; name another file")
        refuse_a_run_file(args.output, output_dir, "--output")
    text_column = "text" if kind in ONE_TEXT_EACH else text_column
    pair_column = args.text_pair_column or (cfg.data.text_pair_column if cfg is not None else None)
    # after the checks above, which need no transformers and, a .txt file's kind aside, no datasets: said at once
    quiet_progress_bars(files=bool(args.file))  # of reading the file and loading the weights; the file's is ours
    if args.threshold is not None:  # against the model's labels before its weights load, in the option's name
        from finetune.tasks import model_labels, refuse_threshold
        names, problem_type = model_labels(output_dir)
        try:
            refuse_threshold(args.threshold, problem_type, names)
        except ValueError as exc:
            raise ConfigError(f"--threshold: {exc}") from None
    if args.file:
        rows = read_rows(args.file, text_column, pair_column, encoding, args.sheet, args.split, args.split_column,
                         run_data=cfg and cfg.data, kind=kind, quoting=args.quoting or (cfg and cfg.data.quoting))
    else:
        if pair_column:
            raise ConfigError(f"this model takes text pairs ({pair_column!r}): use --file with both columns")
        rows, text_column = [{"text": text} for text in args.texts], "text"
    # under accelerate launch every process reads the same rows and runs a share of their batches; the first
    # process says and writes what one process would
    predictor = Predictor.load(output_dir, batch_size=args.batch_size, threshold=args.threshold,
                               precision=args.precision, across_processes=True)
    first = predictor.processes[0] == 0
    prefix, clashes = prediction_prefix(rows, predictor.labels)
    if args.file and first:
        note_the_files_own_columns(args.file, args.output_dir, rows, clashes, prefix,
                                   cfg.data.label_column if cfg is not None else None)
    with out_of_memory_told_as(lambda _: batch_too_large(args.batch_size)):
        predicted = predict_rows(predictor, rows, text_column, pair_column, bool(args.file), prefix, kept=first)
    if not first:
        return
    if args.output:
        delimiter = (cfg.data.label_delimiter if cfg is not None else None) or ","
        write_predictions(args.output, predicted, predictor.labels, delimiter, prefix,
                          separator=output_separator(file, encoding))
    else:
        print_predictions(predicted)
    if args.file:  # a file's predictions summed up in a line, on stderr beside the notes
        print(predictions_summary(predicted, predictor, prefix, output_dir, args.output), file=sys.stderr)


def batch_too_large(batch_size: int) -> OutOfMemory:
    """Out of memory predicting: the ``--batch-size`` that halves the batches (the longest run first, not hours in)."""
    return OutOfMemory(f"out of memory at --batch-size {batch_size}, on the longest texts (they run first)",
                       hint=f"--batch-size {batch_size // 2}" if batch_size > 1 else None)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 for bad input)."""
    args = parse_args(argv)
    notes_to_stderr()  # what reading the --file found, beside the command's own notes
    return run_command(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
