"""One fine-tuned model's predictions: :class:`Predictor`, what ``finetune predict`` and ``finetune score`` run.

It runs a model as its run did: each text cut and padded as the run's saved ``config.yaml`` says, on batches of
similar length (longest first), where training would run (a GPU if there is one), in float32 unless a precision
asks for autocast; under ``accelerate launch`` the processes share the batches (:mod:`finetune.shares`). The same
folder works in plain ``transformers.pipeline("text-classification", model=output_dir)``, which gives the same
numbers. Several runs' models averaged: :class:`finetune.ensemble.Ensemble`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Optional, Sequence

from finetune.errors import PROGRESS_SECONDS_IN_A_FILE, ModelError, redraws_in_place
from finetune.outputs import saved_config
from finetune.precisions import autocast_dtype, resolved_precision
from finetune.prediction_rows import PredictionRows, probabilities_of_logits
from finetune.schema import PAD_TO_MULTIPLE_OF  # the schema alone: no YAML or config loaded
from finetune.shares import (batches_of_share, device_of, launched_processes, lengths_across_processes, logits_in_order,
                             shares_of_every_process)
from finetune.truncation import (Truncation, collator_arguments, cut_of, model_features, padding_for,
                                 prediction_length)

DEFAULT_BATCH_SIZE = 64


class Predictor(PredictionRows):
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
            ``bf16`` or ``fp16`` (autocast; fp16 on a CUDA GPU only), or ``auto`` (bf16 where the device computes
            it faster than float32, as training's ``auto`` decides; else float32). Logits come back in float32
            either way.
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

    # the progress bar's name: an ensemble's member says which it is
    progress_name = "predict"

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
        self.precision = resolved_precision(precision, self.device)  # auto's choice, which a score records
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
            precision: ``no`` (float32), ``bf16``, ``fp16`` or ``auto`` (see the class).
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
        device = device_of(device)
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

    @property
    def decision_config(self):
        """The config whose thresholds decide: the model's own."""
        return self.model.config

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
        with tqdm(total=total, disable=not progress, unit="text", desc=self.progress_name, mininterval=every) as bar, \
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
        if self.problem_type == "regression":
            raise ValueError("a regression model predicts numbers, not probabilities: use logits()")
        return probabilities_of_logits(self.logits(texts, text_pairs, progress), self.problem_type)
