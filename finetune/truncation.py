"""What is kept of a text longer than ``data.max_length``: its head, its tail, or both.

``head`` (the default) keeps the first tokens, as every tokenizer does by
itself. ``tail`` keeps the last ones: where a text ends with its verdict (a
review's last sentence, a ticket's resolution). ``head_tail`` keeps
``data.head_tokens`` from the start and the rest of the window from the end:
Sun et al. (2019, "How to Fine-Tune BERT for Text Classification") found the
first 128 and last 382 tokens of 512 beat both ends alone on IMDb, so the
default head is a quarter of the window. ``chunks`` keeps everything: the
text becomes overlapping windows of ``max_length`` tokens, each sharing
``data.stride`` tokens with the one before, and the model's outputs for a
document's windows are averaged into one (:mod:`finetune.chunks`). Special
tokens ([CLS], [SEP], <s>, </s>) are kept where the tokenizer puts them, in
every window: only the text's own tokens are cut.

transformers' tokenizers cut one side only (``truncation_side``), and only
fast ones return overlapping windows (``return_overflowing_tokens``), each
with its own rules; cutting the middle out and the windows are written here.
Each text is tokenized whole, once, with the special-token mask, and every
returned list (ids, attention mask, token types) is cut at the same
positions, so slow and fast tokenizers agree and a text that fits comes out
exactly as the tokenizer makes it.

A text pair (``data.text_pair_column``) is cut by the tokenizer, ``head`` only:
which of two texts to cut, and where, is the tokenizer's longest-first rule.

How far a batch of cut texts is padded (``data.padding``) is decided here too, at the end: to its own longest text,
or to ``data.max_length`` for every batch. Most encoders mask their padding, so a text's output is the same however
far its batch is padded. Five of transformers' do not: their output for a text depends on the padded length around
it. Padded to each batch's longest text, such an encoder breaks two promises: ``(b, k)``'s update is no longer
``(b*k, 1)``'s (the two pad a text to different lengths), and a text's prediction depends on the texts batched with
it. Padded to one length everywhere (training, evaluation, prediction), it keeps both (``bench/families.py``
measures the five either way), at the cost of computing the padded positions, which an encoder that masks them
need not pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from finetune.columns import read_column
from finetune.errors import ConfigError

TRUNCATIONS = ("head", "tail", "head_tail", "chunks")
LENGTH, FULL_LENGTH, CHUNK_COUNT = "length", "full_length", "chunks"
# columns of a tokenized split for the sampler and the start line, not for the model
BOOKKEEPING = (LENGTH, FULL_LENGTH, CHUNK_COUNT)


# Model types whose embeddings number positions from the padding id + 1 (RoBERTa's scheme), so that
# roberta-base's 514 position embeddings take 512 tokens. transformers' configs do not say so themselves.
_POSITIONS_AFTER_PADDING = frozenset({"roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "camembert",
                                      "data2vec-text", "mpnet", "longformer", "xmod", "ibert", "luke"})


def position_limit(config) -> Optional[int]:
    """The most tokens the model's position embeddings take; ``None`` when it has none to run out of.

    RoBERTa and its kin number positions from the padding id + 1, so
    ``max_position_embeddings`` (514) holds two fewer tokens (512). DeBERTa-v3
    (``position_biased_input: false``) adds no absolute positions: its
    attention sees relative ones in log-sized buckets, so it runs on texts
    longer than its ``max_position_embeddings`` of 512, as long-text
    fine-tuning of it commonly does.
    """
    if getattr(config, "position_biased_input", True) is False:
        return None
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and getattr(config, "model_type", None) in _POSITIONS_AFTER_PADDING:
        limit -= (getattr(config, "pad_token_id", None) or 0) + 1
    return limit


def prediction_length(config, tokenizer, max_length: Optional[int]) -> Optional[int]:
    """The tokens a text keeps: ``max_length`` (the run's ``data.max_length``) within the model's positions;
    without one, what the model and its tokenizer say they take."""
    limits = [position_limit(config), max_length]
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if max_length is None and tokenizer_limit is not None and tokenizer_limit < 10**6:  # "no limit": a huge int
        limits.append(tokenizer_limit)
    known = [x for x in limits if x is not None]
    return min(known) if known else None


def refuse_cutting_pairs(side: str) -> None:
    """A text pair is cut by the tokenizer's longest-first rule, so ``head`` is the one truncation it takes.

    Raises:
        ConfigError: for any other ``side``.
    """
    if side != "head":
        raise ConfigError(f"data.truncation: {side} cuts single texts; with data.text_pair_column "
                          f"only head is supported (the tokenizer's longest-first cut)")


def default_head_tokens(max_length: int) -> int:
    """A quarter of the window: 128 of 512, as Sun et al. measured best."""
    return max_length // 4


def default_stride(max_length: int) -> int:
    """A quarter of the window: a word cut at one window's edge is whole, with some context, in the next."""
    return max_length // 4


@dataclass(frozen=True)
class Truncation:
    """``data.truncation`` at ``data.max_length``, with ``data.head_tokens`` for ``head_tail`` and
    ``data.stride`` for ``chunks``."""

    side: str = "head"
    max_length: int = 128
    head_tokens: Optional[int] = None
    stride_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.side not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {self.side!r}")

    @property
    def head(self) -> int:
        """Tokens of the text kept from its start under ``head_tail`` (special tokens not counted)."""
        return self.head_tokens if self.head_tokens is not None else default_head_tokens(self.max_length)

    @property
    def stride(self) -> int:
        """Tokens each window shares with the one before under ``chunks`` (special tokens not counted)."""
        return self.stride_tokens if self.stride_tokens is not None else default_stride(self.max_length)

    @property
    def chunked(self) -> bool:
        """Whether a long text becomes several rows (``chunks``) rather than one cut row."""
        return self.side == "chunks"

    def key(self) -> list:
        """What the tokens depend on beside ``max_length``: the side and its one number."""
        number = {"head_tail": self.head, "chunks": self.stride}.get(self.side)
        return [self.side, number]

    def describe(self) -> str:
        """What a long text keeps, in words: ``first tokens``, ``last tokens``, ``first 128 and last tokens``;
        under ``chunks``, what it becomes: ``windows overlapping by 32 tokens``."""
        if self.side == "head_tail":
            return f"first {self.head} and last tokens"
        if self.side == "chunks":
            return f"windows overlapping by {self.stride} tokens"
        return "first tokens" if self.side == "head" else "last tokens"

    def encode(self, tokenizer: Any, texts: Sequence[str], pairs: Optional[Sequence[str]] = None
               ) -> dict[str, list]:
        """Tokenize ``texts`` (and ``pairs``) cut to the window, unpadded.

        Returns:
            The tokenizer's lists (``input_ids``, ``attention_mask``,
            ``token_type_ids`` where it makes them), plus ``length``, the tokens
            kept, and ``full_length``, the tokens of the whole text.
        """
        if pairs is not None:
            return self._encode_pairs(tokenizer, texts, pairs)
        whole = tokenizer(list(texts), return_special_tokens_mask=True, verbose=False)
        masks = whole.pop("special_tokens_mask")
        if self.chunked:
            return self._encode_chunks(whole, masks)
        encoded: dict[str, list] = {key: [] for key in whole}
        for row, mask in enumerate(masks):
            keep = self.kept_positions(mask)
            for key, values in whole.items():
                row_values = values[row]
                encoded[key].append(row_values if keep is None else [row_values[i] for i in keep])
        encoded[LENGTH] = [len(ids) for ids in encoded["input_ids"]]
        encoded[FULL_LENGTH] = [len(mask) for mask in masks]
        return encoded

    def _encode_chunks(self, whole, masks: list) -> dict[str, list]:
        """Each text's lists as a list of windows; ``length`` is what the text's windows pad to together."""
        encoded: dict[str, list] = {key: [] for key in whole}
        for row, mask in enumerate(masks):
            windows = self.chunk_positions(mask)
            for key, values in whole.items():
                row_values = values[row]
                encoded[key].append([[row_values[i] for i in window] for window in windows])
        encoded[CHUNK_COUNT] = [len(windows) for windows in encoded["input_ids"]]
        # the text's windows pad to its longest (its first), so a text costs windows x that in a micro-batch
        encoded[LENGTH] = [len(windows) * len(windows[0]) for windows in encoded["input_ids"]]
        encoded[FULL_LENGTH] = [len(mask) for mask in masks]
        return encoded

    def _encode_pairs(self, tokenizer: Any, texts: Sequence[str], pairs: Sequence[str]) -> dict[str, list]:
        refuse_cutting_pairs(self.side)
        encoded = dict(tokenizer(list(texts), list(pairs), truncation=True, max_length=self.max_length))
        encoded[LENGTH] = [len(ids) for ids in encoded["input_ids"]]
        whole = tokenizer(list(texts), list(pairs), verbose=False)["input_ids"]
        encoded[FULL_LENGTH] = [len(ids) for ids in whole]
        return encoded

    def kept_positions(self, special_tokens_mask: Sequence[int]) -> Optional[list[int]]:
        """The positions of a tokenized text that the window keeps; ``None`` when it fits whole.

        Raises:
            ConfigError: for a tokenizer that puts special tokens inside the text, which cannot be cut safely.
        """
        total = len(special_tokens_mask)
        if total <= self.max_length:
            return None
        prefix, content, suffix = self._parts(special_tokens_mask)
        budget = max(0, self.max_length - prefix - suffix)
        if self.side == "head":
            kept = content[:budget]
        elif self.side == "tail":
            kept = content[len(content) - budget:]
        else:
            head = min(self.head, budget)
            kept = [*content[:head], *content[len(content) - (budget - head):]]
        return [*range(prefix), *kept, *range(total - suffix, total)]

    def chunk_positions(self, special_tokens_mask: Sequence[int]) -> list[list[int]]:
        """The positions of each window of a tokenized text under ``chunks``: one window when it fits whole.

        Windows start every ``max_length - special tokens - stride`` text tokens;
        the last one ends at the text's end and may be shorter.

        Raises:
            ConfigError: for a stride that leaves a window no new token, or special tokens inside the text.
        """
        total = len(special_tokens_mask)
        if total <= self.max_length:
            return [list(range(total))]
        prefix, content, suffix = self._parts(special_tokens_mask)
        budget = self.max_length - prefix - suffix
        step = budget - self.stride
        if step < 1:
            raise ConfigError(f"data.stride: {self.stride} leaves a window no new token: a window holds {budget} "
                              f"text tokens (data.max_length {self.max_length} less {prefix + suffix} special); "
                              f"use a stride below {budget}")
        starts = range(0, max(1, len(content) - self.stride), step)
        ends = [*range(total - suffix, total)]
        return [[*range(prefix), *content[start:start + budget], *ends] for start in starts]

    def _parts(self, special_tokens_mask: Sequence[int]) -> tuple[int, range, int]:
        """The special tokens before the text, the text's positions, and the special tokens after it."""
        total = len(special_tokens_mask)
        prefix = next((i for i, special in enumerate(special_tokens_mask) if not special), total)
        suffix = next((i for i, special in enumerate(reversed(special_tokens_mask)) if not special), 0)
        content = range(prefix, total - suffix)
        if any(special_tokens_mask[i] for i in content):
            raise ConfigError(f"data.truncation: {self.side}: this tokenizer puts special tokens inside a text; "
                              f"use head")
        return prefix, content, suffix


def cut_of(data) -> dict[str, Any]:
    """A run's cut and padding of a text (its ``data`` config section) as :class:`~finetune.predictor.Predictor`'s
    arguments: a head_tail model sees head and tail in prediction too."""
    return {"truncation": data.truncation, "head_tokens": data.head_tokens, "stride": data.stride,
            "pad_to_multiple_of": data.pad_to_multiple_of, "padding": data.padding}


def model_features(tokenizer: Any, truncation: Optional[Truncation], texts: Sequence[str],
                   pairs: Optional[Sequence[str]] = None) -> tuple[list[dict[str, list]], list[int]]:
    """Each text's model inputs, cut as ``truncation`` cuts it (``None``: as the tokenizer leaves it), and its
    length in tokens (under ``chunks``, what its windows pad to together: :meth:`Truncation.encode`'s ``length``)."""
    if not texts:
        return [], []  # the tokenizer refuses an empty batch
    if truncation is not None:
        encoded = truncation.encode(tokenizer, texts, pairs)
    else:
        encoded = dict(tokenizer(list(texts), list(pairs) if pairs is not None else None))
    lengths = encoded[LENGTH] if LENGTH in encoded else [len(ids) for ids in encoded["input_ids"]]
    return [{key: encoded[key][i] for key in encoded if key not in BOOKKEEPING} for i in range(len(texts))], lengths


@dataclass(frozen=True)
class LongTexts:
    """How many texts of a split the window cut, and how long the longest was (start line, model card)."""

    rows: int
    longer: int
    longest: int
    max_length: int
    truncation: str  # data.truncation
    kept: str  # what a cut text kept, in words (Truncation.describe)
    chunks: Optional[int] = None  # data.truncation: chunks: the windows of all rows

    def describe(self) -> str:
        """``412 longer than 256 tokens, up to 4,102: kept their first 64 and last tokens``; empty when none is.

        Under ``chunks``: ``412 longer than 256 tokens, up to 4,102: split into windows overlapping by 64
        tokens (3,310 windows in all)``.
        """
        if not self.longer:
            return ""
        done = (f"split into {self.kept} ({self.chunks:,} windows in all)" if self.chunks is not None
                else f"kept their {self.kept}")
        return f"{self.longer} longer than {self.max_length} tokens, up to {self.longest:,}: {done}"

    def record(self) -> dict[str, Any]:
        record = {"rows": self.rows, "longer_than_max_length": self.longer, "longest_tokens": self.longest,
                  "max_length": self.max_length, "truncation": self.truncation, "kept": self.kept}
        if self.chunks is not None:
            record["chunks"] = self.chunks
        return record


def text_lengths(split) -> list[int]:
    """Each text's tokens in a tokenized ``split``, what its micro-batch pads it to (its ``length`` column)."""
    return read_column(split, LENGTH)


def long_texts(split, truncation: Truncation) -> LongTexts:
    """Count the texts of a tokenized ``split`` longer than the window (and their windows under ``chunks``)."""
    full = read_column(split, FULL_LENGTH) if len(split) else []
    chunks = sum(read_column(split, CHUNK_COUNT)) if truncation.chunked and len(split) else None
    return LongTexts(rows=len(split), longer=sum(n > truncation.max_length for n in full),
                     longest=max(full, default=0), max_length=truncation.max_length,
                     truncation=truncation.side, kept=truncation.describe(), chunks=chunks)


def model_inputs(split):
    """``split`` without the bookkeeping columns: what the collator and the model take."""
    return split.remove_columns([c for c in BOOKKEEPING if c in split.column_names])


def truncation_of(data) -> Truncation:
    """The :class:`Truncation` a ``DataConfig`` (or a saved run's) sets."""
    return Truncation(data.truncation, data.max_length, data.head_tokens, data.stride)


# --------------------------------------------------------------------------- padding


# transformers' model types whose output for a text reads the padding around it, and how (docs/accumulation.md)
READS_THE_PADDING = {
    "convbert": "its convolutions read the padded positions beside a text",
    "big_bird": "its block-sparse attention lays its blocks over the padded length",
    "nystromformer": "its landmarks average over the padded length",
    "yoso": "its hashed attention averages over the padded length",
    "fnet": "its Fourier transform mixes every position, padding included",
}


def reads_the_padding(model_config: Any) -> Optional[str]:
    """How the model's output for a text reads the padding around it; ``None`` for a model that masks it."""
    return READS_THE_PADDING.get(getattr(model_config, "model_type", None))


@dataclass(frozen=True)
class Padding:
    """How a run pads its batches: ``data.padding`` resolved for its model."""

    setting: str  # data.padding
    length: Optional[int]  # every batch padded to this many tokens; None: each batch to its longest text
    model_type: Optional[str]
    longest: Optional[int] = None  # the longest training text's tokens, where known

    @property
    def reads(self) -> Optional[str]:
        """How the model's output for a text reads the padding; ``None`` where the model masks it."""
        return READS_THE_PADDING.get(self.model_type)

    def describe(self) -> str:
        """For the start line: the one length and why; nothing where each batch is padded to its longest text."""
        if self.length is None:
            return ""
        why = f"auto: {self.model_type} reads the padding, {self.reads}" if self.setting == "auto" else "data.padding"
        return f"padding={self.length} ({why})"

    def caution(self) -> Optional[str]:
        """A line for a model that reads the padding, each of whose batches is padded to its own longest text; or for
        batches padded to one length at least twice the longest training text's, which a shorter
        ``data.max_length`` would compute as exactly, and faster."""
        if self.length is not None and self.longest is not None and 2 * self.longest <= self.length:
            why = f"{self.model_type} reads the padding" if self.setting == "auto" else "data.padding=max_length"
            return (f"every batch is padded to data.max_length={self.length} tokens ({why}), and the longest training "
                    f"text has {self.longest}: data.max_length={self.longest} would compute "
                    f"{self.length / self.longest:.1f}x fewer tokens a batch (longer validation or test texts cut "
                    f"there too)")
        if self.reads is None or self.length is not None:
            return None
        return (f"{self.model_type} reads the padding ({self.reads}), and data.padding={self.setting} pads each "
                f"batch to its longest text: (b, k)'s updates will be close to (b*k, 1)'s, not equal, and a text's "
                f"predictions will depend on the texts batched with it; data.padding=auto pads every batch to "
                f"data.max_length (docs/accumulation.md, which models keep it)")


def padding_for(setting: str, max_length: Optional[int], model_config: Any, longest: Optional[int] = None) -> Padding:
    """``data.padding`` for a model: ``auto`` pads every batch to ``max_length`` for an encoder that reads the
    padding, each batch to its longest text (rounded up to ``data.pad_to_multiple_of``) for the rest;
    ``max_length`` and ``longest`` do so for every model. Without a ``max_length`` (a model with no position limit,
    read without one) there is no one length to pad to. ``longest``: the longest training text's tokens, which
    :meth:`Padding.caution` weighs one length against."""
    one_length = setting == "max_length" or (setting == "auto" and reads_the_padding(model_config) is not None)
    return Padding(setting, max_length if one_length else None, getattr(model_config, "model_type", None), longest)


def collator_arguments(fixed: Optional[int], multiple: Optional[int]) -> dict[str, Any]:
    """``DataCollatorWithPadding``'s padding arguments: every batch to ``fixed`` tokens, or (``None``) each to its
    longest text rounded up to a multiple of ``multiple``."""
    if fixed is not None:
        return {"padding": "max_length", "max_length": fixed}
    return {"pad_to_multiple_of": multiple}
