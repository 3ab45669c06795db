"""Classify texts with a fine-tuned model: ``python -m finetune.predict``.

Usage::

    python -m finetune.predict outputs/sms_spam "WIN a free prize, call now" "see you at lunch"
    python -m finetune.predict outputs/sms_spam --file messages.txt --output predictions.csv
    python -m finetune.predict outputs/sms_spam --file messages.jsonl --output predictions.jsonl

Each prediction has the label, its probability (``score``) and the
probability of every class. Command-line texts print as JSON lines; ``--file``
reads ``.txt`` (one text per line), ``.csv``/``.tsv`` (with a header) or
``.jsonl`` (one object per line) and writes ``.csv`` or ``.jsonl`` in the same
order as the input (to stdout as JSON lines without ``--output``), with a
progress bar.

The model runs where training would run (Accelerate's device choice: a GPU
if there is one), in float32, on batches of similar length so padding stays
small; texts are truncated to the run's ``data.max_length`` (from the saved
``config.yaml``). The same directory also works in plain
``transformers.pipeline("text-classification", model=output_dir)``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from finetune.errors import ConfigError, DataError, ModelError, run_command

INPUT_FORMATS = (".txt", ".csv", ".tsv", ".jsonl")
OUTPUT_FORMATS = (".csv", ".jsonl")
DEFAULT_BATCH_SIZE = 64


def saved_config(output_dir: str | os.PathLike):
    """The :class:`~finetune.config.Config` a run saved as ``config.yaml``, or ``None`` if there is none.

    Raises:
        ConfigError: if the file exists but is not a valid config.
    """
    from finetune.config import config_from_dict, read_yaml
    from finetune.outputs import CONFIG_FILE

    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    return config_from_dict(read_yaml(path), source=str(path))


class Predictor:
    """Batched class probabilities from a sequence-classification model.

    ``transformers.pipeline("text-classification")`` gives the same numbers
    (tested); this runs the texts longest first, so a file of mixed lengths
    pads far less, and returns arrays for the metrics.

    Args:
        model: A ``*ForSequenceClassification`` model whose config has ``id2label``.
        tokenizer: Its tokenizer.
        device: Where to run; ``None`` keeps the model where it is.
        batch_size: Texts per forward pass.
        max_length: Truncate inputs to this many tokens (``None``: the
            tokenizer's and the model's limits).
    """

    def __init__(self, model, tokenizer, *, device=None, batch_size: int = DEFAULT_BATCH_SIZE,
                 max_length: Optional[int] = None):
        import torch

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if device is not None:
            self.model.to(self.device)
        self.batch_size = batch_size
        limits = [getattr(model.config, "max_position_embeddings", None), max_length]
        tokenizer_limit = getattr(tokenizer, "model_max_length", None)
        if tokenizer_limit is not None and tokenizer_limit < 10**6:  # "no limit" is stored as a huge int
            limits.append(tokenizer_limit)
        self.max_length = min(x for x in limits if x is not None) if any(x is not None for x in limits) else None
        self.labels = [model.config.id2label[i] for i in range(model.config.num_labels)]

    @classmethod
    def load(cls, output_dir: str | os.PathLike, *, device=None, batch_size: int = DEFAULT_BATCH_SIZE,
             max_length: Optional[int] = None) -> "Predictor":
        """Load the model and tokenizer that a run saved in ``output_dir``.

        Args:
            output_dir: A run's ``output.output_dir`` (or any directory
                ``AutoModelForSequenceClassification`` can load).
            device: ``None`` picks the device as training does (Accelerate's
                ``PartialState``: GPU if available, else CPU, using all cores).
            batch_size: Texts per forward pass.
            max_length: Truncation length; ``None`` uses ``data.max_length``
                from the run's ``config.yaml`` when there is one.

        Raises:
            ModelError: if ``output_dir`` holds no loadable model.
            ConfigError: if its ``config.yaml`` is invalid.
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from finetune.modeling import require_saved_model

        path = require_saved_model(output_dir)
        if max_length is None:
            cfg = saved_config(path)
            max_length = cfg.data.max_length if cfg is not None else None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(path)
        except (OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(f"{path}: cannot load the model: {first}") from None
        model.eval()
        if device is None:
            device = _training_device()
        return cls(model, tokenizer, device=device, batch_size=batch_size, max_length=max_length)

    def logits(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
               progress: bool = False) -> "np.ndarray":  # noqa: F821
        """Float32 logits, one row per text, in input order.

        Texts are tokenized once, then run longest first in batches of
        ``batch_size`` so each batch pads to similar lengths; the rows are put
        back in input order.

        Args:
            texts: The texts.
            text_pairs: Second texts of sentence pairs (same length), for a
                model trained on pairs.
            progress: Show a tqdm bar (counts texts).
        """
        import numpy as np
        import torch
        from tqdm.auto import tqdm
        from transformers import DataCollatorWithPadding

        texts = list(texts)
        if text_pairs is not None and len(text_pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(text_pairs)} text pairs")
        out = np.zeros((len(texts), len(self.labels)), dtype=np.float32)
        if not texts:
            return out
        encoded = self.tokenizer(texts, list(text_pairs) if text_pairs is not None else None,
                                 truncation=self.max_length is not None, max_length=self.max_length)
        features = [{key: encoded[key][i] for key in encoded} for i in range(len(texts))]
        order = sorted(range(len(texts)), key=lambda i: -len(features[i]["input_ids"]))
        collate = DataCollatorWithPadding(self.tokenizer, return_tensors="pt")
        was_training = self.model.training
        self.model.eval()
        with tqdm(total=len(texts), disable=not progress, unit="text", desc="predict") as bar, torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                batch = {k: v.to(self.device) for k, v in collate([features[i] for i in rows]).items()}
                out[rows] = self.model(**batch).logits.float().cpu().numpy()
                bar.update(len(rows))
        if was_training:
            self.model.train()
        return out

    def probabilities(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
                      progress: bool = False) -> "np.ndarray":  # noqa: F821
        """Class probabilities (softmax of :meth:`logits`), columns in class-id order (``self.labels``)."""
        import numpy as np

        logits = self.logits(texts, text_pairs, progress).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)

    def predict(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
                progress: bool = False) -> list[dict[str, Any]]:
        """``{"label", "score", "probabilities": {label: p}}`` per text, in input order."""
        probs = self.probabilities(texts, text_pairs, progress)
        results = []
        for row in probs:
            best = int(row.argmax())
            results.append({
                "label": self.labels[best],
                "score": float(row[best]),
                "probabilities": {name: float(p) for name, p in zip(self.labels, row)},
            })
        return results


def _training_device():
    """The device training would use in a single process (Accelerate's choice), with all CPU cores."""
    from accelerate import PartialState

    from finetune.launch import configure_cpu_threads

    state = PartialState()
    configure_cpu_threads(state.device, 1)
    return state.device


# --------------------------------------------------------------------------- files


def _suffix(path: Path, allowed: Sequence[str], what: str) -> str:
    suffix = path.suffix.lower()
    if suffix not in allowed:
        raise DataError(f"{what} {path}: unsupported extension {suffix or '(none)'!r} (use {', '.join(allowed)})")
    return suffix


def read_texts(path: str | os.PathLike, text_column: str = "text",
               text_pair_column: Optional[str] = None) -> tuple[list[str], Optional[list[str]]]:
    """Texts (and second texts of pairs) from a ``.txt``, ``.csv``, ``.tsv`` or ``.jsonl`` file.

    ``.txt`` holds one text per line (blank lines are skipped); the others
    are read by :func:`finetune.data.read_table`, as training data is, and
    name the text in ``text_column`` (a CSV/TSV header, or a JSON key).

    Raises:
        DataError: naming the file (and line or column) if it is missing, has
            an unsupported extension, lacks the column, or holds a bad line.
    """
    from finetune.data import read_table

    path = Path(path)
    suffix = _suffix(path, INPUT_FORMATS, "--file")
    if not path.is_file():
        raise DataError(f"--file {path}: not found")
    wanted = [text_column] + ([text_pair_column] if text_pair_column else [])
    if suffix == ".txt":
        if text_pair_column:
            raise DataError(f"--file {path}: a .txt file holds single texts; this model takes pairs "
                            f"(use .csv or .jsonl with a {text_pair_column!r} column)")
        try:
            with open(path, encoding="utf-8-sig", newline="") as fh:
                texts = [line.rstrip("\r\n") for line in fh if line.strip()]
        except UnicodeDecodeError as exc:
            raise DataError(f"--file {path}: not UTF-8 text (byte offset {exc.start})") from None
        pairs = None
    else:
        # the readers training uses: the same formats, quoting and encoding checks
        table = read_table(str(path), "--file")
        for column in wanted:
            if column not in table.column_names:
                where = "in the header" if suffix in (".csv", ".tsv") else "among the keys"
                raise DataError(f"--file {path}: no column {column!r} {where} "
                                f"({', '.join(table.column_names) or 'empty'}); pass --text-column")
        texts = ["" if t is None else str(t) for t in table[text_column]]
        pairs = ["" if t is None else str(t) for t in table[text_pair_column]] if text_pair_column else None
    if not texts:
        raise DataError(f"--file {path}: no texts in it")
    return texts, pairs


def write_predictions(path: str | os.PathLike, texts: Sequence[str], predictions: Iterable[dict[str, Any]],
                      labels: Sequence[str], text_pairs: Optional[Sequence[str]] = None) -> None:
    """Write predictions as ``.csv`` (``text, label, score, prob_<label>...``) or ``.jsonl``."""
    path = Path(path)
    suffix = _suffix(path, OUTPUT_FORMATS, "--output")
    with open(path, "w", encoding="utf-8", newline="") as fh:
        if suffix == ".csv":
            writer = csv.writer(fh)
            writer.writerow(["text"] + (["text_pair"] if text_pairs is not None else [])
                            + ["label", "score"] + [f"prob_{name}" for name in labels])
            for i, (text, p) in enumerate(zip(texts, predictions)):
                writer.writerow([text] + ([text_pairs[i]] if text_pairs is not None else [])
                                + [p["label"], p["score"]] + [p["probabilities"][name] for name in labels])
        else:
            for record in _records(texts, predictions, text_pairs):
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def _records(texts, predictions, text_pairs=None):
    for i, (text, p) in enumerate(zip(texts, predictions)):
        head = {"text": text, **({"text_pair": text_pairs[i]} if text_pairs is not None else {})}
        yield {**head, **p}


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.predict",
                                     description="Classify texts with a fine-tuned model.")
    parser.add_argument("output_dir", help="a run's output directory (the saved model)")
    parser.add_argument("texts", nargs="*", help="texts to classify (printed as JSON lines)")
    parser.add_argument("--file", default=None, help="classify the texts of a .txt, .csv, .tsv or .jsonl file")
    parser.add_argument("--output", default=None, help="write the file's predictions to a .csv or .jsonl file")
    parser.add_argument("--text-column", default=None,
                        help="CSV column / JSON key of the text (default: the run's data.text_column)")
    parser.add_argument("--text-pair-column", default=None,
                        help="column of the second text, for models trained on pairs (default: the run's)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="texts per forward pass")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """Check every argument, load the model, predict, write. Raises FinetuneError on bad input."""
    from finetune.data import quiet_progress_bars

    quiet_progress_bars()  # the bars of reading the file and loading the weights; the file's bar is ours
    if not args.texts and not args.file:
        raise ConfigError("nothing to classify: give texts or --file")
    if args.texts and args.file:
        raise ConfigError("give texts or --file, not both")
    if args.output and not args.file:
        raise ConfigError("--output: only with --file")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.output:
        _suffix(Path(args.output), OUTPUT_FORMATS, "--output")
        if not Path(args.output).resolve().parent.is_dir():
            raise DataError(f"--output {args.output}: its directory does not exist")
    output_dir = Path(args.output_dir)
    if not output_dir.is_dir():
        raise ModelError(f"{output_dir}: not found (pass a run's output_dir)")
    cfg = saved_config(output_dir)
    text_column = args.text_column or (cfg.data.text_column if cfg is not None else "text")
    pair_column = args.text_pair_column or (cfg.data.text_pair_column if cfg is not None else None)
    pairs = None
    if args.file:
        texts, pairs = read_texts(args.file, text_column, pair_column)
    else:
        if pair_column:
            raise ConfigError(f"this model takes text pairs ({pair_column!r}): use --file with both columns")
        texts = list(args.texts)
    predictor = Predictor.load(output_dir, batch_size=args.batch_size)
    predictions = predictor.predict(texts, pairs, progress=bool(args.file))
    if args.output:
        write_predictions(args.output, texts, predictions, predictor.labels, pairs)
    else:
        for record in _records(texts, predictions, pairs):
            print(json.dumps(record, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 for bad input)."""
    args = parse_args(argv)
    return run_command(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
