"""From data files to micro-batches: loading and tokenizing the splits, collating, the training order, the cut.

* :func:`load_data` and :func:`tokenize_data` read the splits and their tokens
  (the main process first, so the others find its caches, and says what it found alone);
* :func:`collator` pads each micro-batch (:class:`BucketPadding` under ``torch_compile`` or ``cuda_graphs``);
* :func:`training_sampler` decides the training order: seeded, length-grouped
  within each epoch's windows of ``b * k * P`` samples;
* :func:`balance_micro_batches` decides whether a window is cut into equal
  micro-batches or where it pads least (:class:`~finetune.sampling.BalancedBatches`);
* :func:`build_dataloaders` puts them together.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from finetune.accumulation import Batching
from finetune.config import PAD_TO_MULTIPLE_OF, Config
from finetune.errors import ConfigError, FinetuneError
from finetune.launch import choose_workers
from finetune.sampling import BalancedBatches, EpochSampler


def tokenized_cache_dir(cfg: Config) -> Optional[Path]:
    """The checked folder of the tokenization cache, or ``None`` when ``data.cache_tokenized`` is off."""
    from finetune.tokens import default_cache_dir, prepare_cache_dir

    if not cfg.data.cache_tokenized:
        return None
    return prepare_cache_dir(cfg.data.cache_dir or default_cache_dir())


def load_data(cfg: Config, accelerator, head: Optional[list[str]] = None):
    """The data's splits, label space and test set (the main process first, so that others find its caches);
    ``head``: the classes of the trained head the run starts from, whose order the label ids take where they are
    the data's. The test set (:mod:`finetune.test_set`, ``None`` without one) is read now, with the rest, and
    scored by the saved model at the end."""
    from finetune.data import load_splits, load_test_split
    from finetune.test_set import as_test_set

    def read():
        splits, labels = load_splits(cfg.data, seed=cfg.split_seed, problem_type=cfg.model.problem_type, head=head)
        return splits, labels, load_test_split(cfg.data, labels)

    splits, labels, test = main_process_first(accelerator, read)
    return splits, labels, as_test_set(test, cfg, splits["train"])


def tokenize_data(cfg: Config, splits, tokenizer, accelerator, cache_dir: Optional[Path],
                  row_digests: Optional[dict[str, str]] = None):
    """The tokenized splits; the main process tokenizes (and caches) first, the others then read its files. A
    large split is tokenized by several processes (``data.tokenize_processes``). ``row_digests``: the splits'
    content digests the run has already (:func:`finetune.tokens.tokenize_splits`)."""
    from finetune.tokens import tokenize_splits
    from finetune.truncation import truncation_of

    def tokenize():
        return tokenize_splits(splits, tokenizer, cfg.data.max_length, cache_dir=cache_dir,
                               truncation=truncation_of(cfg.data), processes=cfg.data.tokenize_processes,
                               row_digests=row_digests)

    return main_process_first(accelerator, tokenize)


def main_process_first(accelerator, read: Callable[[], Any]) -> Any:
    """``read()`` on the main process first, which fills the caches the others then find, and on the others after
    it, saying its warnings once (:func:`said_by_the_main_process`).

    An error of the input that the main process meets (a bad row, a column that is not there) is sent to the
    others, which wait for its outcome, and every process raises it at once: the package's one line, printed by the
    main one. Raised on the main process alone (as from inside Accelerate's ``main_process_first``), it left the
    others waiting in its barrier, to leave it with a traceback each (gloo's lost connection, or the stop torchrun
    sends them); had they read the files themselves, torchrun would have stopped them mid-read, a traceback each.
    """
    if accelerator.num_processes == 1:
        return read()
    from accelerate.utils import broadcast_object_list

    met: list[Optional[FinetuneError]] = [None]
    if accelerator.is_main_process:
        try:
            result = read()
        except FinetuneError as exc:
            met[0] = exc
    broadcast_object_list(met)  # the others wait here for the main process's outcome
    if met[0] is not None:
        raise met[0]
    if accelerator.is_main_process:
        return result
    with said_by_the_main_process(accelerator):
        return read()


@contextlib.contextmanager
def said_by_the_main_process(accelerator):
    """The package's warnings of the data, said by the main process alone: every process reads the same files and
    would say the same (each dropped row eight times on eight GPUs). Errors are raised everywhere, as before."""
    package = logging.getLogger("finetune")
    level = package.level
    if not accelerator.is_main_process:
        package.setLevel(logging.ERROR)
    try:
        yield
    finally:
        package.setLevel(level)


def count_long_texts(cfg: Config, train):
    """How many texts of the tokenized ``train`` split ``data.max_length`` cut (a :class:`~finetune.truncation.LongTexts`)."""
    from finetune.truncation import long_texts, truncation_of

    return long_texts(train, truncation_of(cfg.data))


def count_unknown_words(tokenizer, splits, tokenized, accelerator):
    """What of the training texts the tokenizer reads as its unknown token (a
    :class:`~finetune.unknown_words.UnknownWords`, ``None`` for a tokenizer without one), warned of by the main
    process where it is more than a stray symbol."""
    from finetune.unknown_words import count_unknown_words as count, say_unknown_words

    found = count(tokenizer, splits["train"], tokenized["train"])
    if accelerator.is_main_process:
        say_unknown_words(found)
    return found


def count_seen_in_training(splits) -> int:
    """How many rows of ``splits["validation"]`` have a text (with its pair) that a training row has too.

    Collected data repeats itself (the SMS Spam Collection holds 328 repeats
    among its 4862 messages), so a carve puts copies on both sides, and a
    validation file can share rows with the training file. Such a row is
    scored on a text the model was trained on: the start line counts them.
    """
    from finetune.data import rows_seen_in

    return rows_seen_in(splits["train"], splits["validation"]) if "validation" in splits else 0


def longest_text(split) -> Optional[int]:
    """The most tokens a text of the tokenized ``split`` has (``None`` for an empty one)."""
    from finetune.truncation import text_lengths

    return max(text_lengths(split), default=None)


def bucket_lengths(top: int, buckets: int) -> list[int]:
    """``buckets`` lengths evenly apart up to ``top``, the last ``top`` itself (fewer where ``top`` is short)."""
    return sorted({max(1, -(-top * i // buckets)) for i in range(1, buckets + 1)})


class BucketPadding:
    """Pad each micro-batch to the smallest of a few fixed lengths that holds its longest text.

    A CUDA graph holds one shape; with padding to the longest text of each
    micro-batch nearly every micro-batch is a new shape. ``buckets`` lengths,
    evenly apart up to the longest text they must hold (``longest``, the
    training set's, or ``max_length`` itself), bound the graphs at that many
    per batch size: a row is padded by less than one bucket's width, which
    ``longest`` narrows where every text is shorter than ``max_length``.
    (``torch.compile`` alone needs no such bound: from its second shape it
    compiles the length as dynamic. A compiled run pads to these lengths all
    the same, as its measurements did.) The collators of
    transformers pad to the longest text, to ``max_length`` or to a multiple;
    none pads to the nearest of a few sizes, hence this wrapper.
    """

    def __init__(self, tokenizer, max_length: int, buckets: int = 4, longest: Optional[int] = None):
        from transformers import DataCollatorWithPadding

        self.sizes = bucket_lengths(max_length if longest is None else max(1, min(max_length, longest)), buckets)
        self._pad = {size: DataCollatorWithPadding(tokenizer, padding="max_length", max_length=size)
                     for size in self.sizes}

    def size_for(self, longest: int) -> int:
        return next((size for size in self.sizes if size >= longest), self.sizes[-1])

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        longest = max(len(f["input_ids"]) for f in features)
        return self._pad[self.size_for(longest)](features)


def fixed_lengths(cfg: Config, accelerator, checkpointing: bool = False) -> bool:
    """Whether ``training.cuda_graphs`` wants micro-batches of a few fixed lengths: where graphs run
    (eager steps gain nothing from padding further). The memory plan's probe asks before
    ``gradient_checkpointing: auto`` is decided, and so pads as graphs would, the longer of the two."""
    from finetune.cuda_graphs import graphed
    from finetune.truncation import truncation_of

    return graphed(cfg.training.cuda_graphs, accelerator, checkpointing=checkpointing,
                   chunked=truncation_of(cfg.data).chunked)


def batch_padding(cfg: Config, model_config, longest: Optional[int] = None):
    """How the run pads its batches (``data.padding`` for its model, :func:`finetune.truncation.padding_for`): the
    :class:`~finetune.truncation.Padding` whose ``length`` :func:`collator` and :func:`build_dataloaders` take as
    ``fixed``. ``longest``: the longest training text's tokens (:func:`longest_text`)."""
    from finetune.truncation import padding_for

    return padding_for(cfg.data.padding, cfg.data.max_length, model_config, longest)


def collator(tokenizer, accelerator, cfg: Optional[Config] = None, checkpointing: bool = False,
             evaluation: bool = False, longest: Optional[int] = None, fixed: Optional[int] = None):
    """Dynamic padding, to a multiple of ``data.pad_to_multiple_of``; under ``training.torch_compile`` or
    ``training.cuda_graphs``, padding to a few fixed lengths (:class:`BucketPadding`) up to ``longest`` (the
    training set's longest text); every batch to ``fixed`` tokens where ``data.padding`` asks for one length
    (:func:`finetune.truncation.padding_for`: a bucket of one length, which graphs and a compile take as theirs);
    under ``data.truncation: chunks``, a row per window and a label per text
    (:class:`~finetune.chunks.ChunkCollator`). ``checkpointing``: gradient checkpointing is on (no graphs
    then); ``evaluation``: the evaluation loader's, fixed only for a compiled model (graphs replay training's
    micro-batches alone), up to ``max_length`` (its texts may be longer than training's)."""
    from transformers import DataCollatorWithPadding

    from finetune.chunks import ChunkCollator
    from finetune.cuda_graphs import MAX_GRAPHS
    from finetune.truncation import truncation_of

    graphs = not evaluation and cfg is not None and fixed_lengths(cfg, accelerator, checkpointing)
    if fixed is not None:
        pad = BucketPadding(tokenizer, fixed, buckets=1)
    elif cfg is not None and (cfg.training.torch_compile or graphs):
        # as many lengths as a run keeps graphs: each is a capture of a fraction of a second, and under
        # torch_compile no compile of its own (the first length compiles, the second compiles again with the
        # length dynamic, and that serves the rest), so more lengths only pad less
        pad = BucketPadding(tokenizer, cfg.data.max_length, MAX_GRAPHS, longest=None if evaluation else longest)
    else:
        # fewer shapes: GPU tensor cores work on multiples of 8, and a CPU's oneDNN builds a kernel per shape
        multiple = cfg.data.pad_to_multiple_of if cfg is not None else PAD_TO_MULTIPLE_OF
        pad = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)
    return ChunkCollator(pad) if cfg is not None and truncation_of(cfg.data).chunked else pad


def training_sampler(cfg: Config, lengths, batching: Batching) -> EpochSampler:
    """The training order of a config: seeded, length-grouped within windows of each epoch's effective
    batch (or within mega-batches of ``data.length_group_windows`` windows)."""
    return EpochSampler(
        len(lengths),
        seed=cfg.training.seed,
        lengths=lengths,
        group_by_length=cfg.data.group_by_length,
        window_size=batching.window_sizes(),
        group_windows=cfg.data.length_group_windows,
    )


def balance_micro_batches(cfg: Config, num_processes: int, device_type: str, fixed: Optional[int] = None) -> bool:
    """Whether ``data.balance_micro_batches`` applies.

    ``auto``: on one process on a CPU, with length grouping and no ``torch_compile``, where each
    micro-batch is padded to its own longest text (not to one length, ``fixed``). On
    several processes Accelerate deals micro-batches of one size round-robin; a compiled
    model would meet a new batch shape at nearly every micro-batch; and on a GPU, where a
    micro-batch costs its kernel launches more than its padding, the many new shapes cost
    more than the padding saved (3.5x slower on an H100, ``bench/README.md``).

    Raises:
        ConfigError: for ``true`` where it cannot apply.
    """
    setting = cfg.data.balance_micro_batches
    why_not = ("it needs one process" if num_processes > 1
               else "it needs data.group_by_length: true" if not cfg.data.group_by_length
               else "it does not combine with training.torch_compile" if cfg.training.torch_compile
               else f"every micro-batch is padded to {fixed} tokens (data.padding)" if fixed is not None else None)
    if setting is True and why_not:
        raise ConfigError(f"data.balance_micro_batches: true, but {why_not}; use auto (or false)")
    return setting is True or (setting == "auto" and why_not is None and device_type == "cpu")


def build_dataloaders(cfg: Config, tokenized, tokenizer, accelerator, batching: Batching,
                      checkpointing: bool = False, fixed: Optional[int] = None):
    """Training and evaluation dataloaders (unprepared).

    The training order comes from :class:`~finetune.sampling.EpochSampler`;
    evaluation runs over the validation set sorted by length (the order does
    not matter to the metrics, and sorting pads least). ``checkpointing``:
    gradient checkpointing as decided, under which no CUDA graph runs; ``fixed``: the one length every
    batch is padded to (:func:`finetune.truncation.padding_for`), if any.
    """
    from torch.utils.data import DataLoader

    from finetune.truncation import model_inputs, text_lengths

    lengths = text_lengths(tokenized["train"])
    collate = collator(tokenizer, accelerator, cfg, checkpointing, longest=max(lengths, default=None), fixed=fixed)
    train = model_inputs(tokenized["train"])
    sampler = training_sampler(cfg, lengths, batching)
    b = batching.per_device_batch_size
    if balance_micro_batches(cfg, accelerator.num_processes, accelerator.device.type, fixed):
        batches: dict[str, Any] = {"batch_sampler": BalancedBatches(sampler, b, cfg.data.pad_to_multiple_of)}
    else:
        batches = {"batch_size": b, "sampler": sampler, "drop_last": False}
    pin = accelerator.device.type == "cuda"
    workers = choose_workers(cfg.data.num_workers, accelerator.device, accelerator.num_processes)
    # A DataLoader without a generator draws a seed from the global torch RNG each time it is
    # iterated; its own generator leaves the global RNG (dropout) to the updates alone, which
    # makes a resumed run's dropout masks those of the uninterrupted run.
    train_dl = DataLoader(
        train,
        **batches,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(cfg.training.seed),
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
    )
    eval_dl = None
    if "validation" in tokenized:
        # longest first, so padding is least and an out-of-memory shows at the first batch
        # (select by argsort rather than Dataset.sort, which trips a pyarrow deprecation warning)
        order = np.argsort(-np.asarray(text_lengths(tokenized["validation"])), kind="stable")
        val = model_inputs(tokenized["validation"].select(order))
        eval_dl = DataLoader(
            val, batch_size=cfg.training.per_device_eval_batch_size, pin_memory=pin,
            collate_fn=collator(tokenizer, accelerator, cfg, checkpointing, evaluation=True, fixed=fixed),
            generator=torch.Generator().manual_seed(cfg.training.seed),
        )
    return train_dl, eval_dl
