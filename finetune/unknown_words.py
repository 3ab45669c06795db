"""Words of the training texts that the model's tokenizer reads as its unknown token.

A WordPiece or SentencePiece vocabulary built for one language has no token for a character it never saw: an
emoji, a script of another language. It reads such a character as its unknown token (``[UNK]``), and WordPiece
reads the whole word around it so: the English MiniLM reads "😂", "❤" and "재미있는" as one and the same input,
and a Thai sentence as a single ``[UNK]``. Nothing fails: the run trains on what is left and its scores say only
that they are low. :func:`count_unknown_words` counts them in the tokenized training split (no second pass of the
tokenizer over it), and names the commonest words from the texts that hold them; the run warns when they are more
than a stray symbol (:data:`WORTH_SAYING`), and the count goes into ``metrics.json`` and the model card.

Byte-level tokenizers (RoBERTa's, ModernBERT's, GPT-2's) have a token for every byte and no unknown token: there
is nothing to count. Under ``data.truncation: chunks`` a token that two overlapping windows share counts twice.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from finetune.columns import arrow_column, read_column

logger = logging.getLogger("finetune.data")

# the share of the training texts that must hold an unknown word for the run to warn: a symbol in one text of a
# thousand is noise; one text in fifty is a pattern (an emoji its label turns on, a second language)
WORTH_SAYING = 0.02
# how many of the texts holding one are tokenized again to name their words, and how many words are named
TEXTS_READ_FOR_WORDS = 2000
WORDS_NAMED = 5
# a word is shown up to this many characters (a Thai or Chinese sentence with no spaces is one "word")
WORD_SHOWN = 24
DOCS = "docs/configuration.md#words-the-tokenizer-does-not-know"


@dataclass(frozen=True)
class UnknownWords:
    """How much of the training texts the tokenizer reads as its unknown token."""

    texts: int  # training texts
    holding: int  # texts with at least one unknown token
    tokens: int  # the texts' tokens, special tokens not counted
    unknown: int  # of them, unknown tokens
    unk_token: str  # the tokenizer's unknown token, as it writes it
    commonest: tuple[tuple[str, int], ...] = ()  # the words read as unknown, commonest first (fast tokenizers)

    @property
    def worth_saying(self) -> bool:
        """Whether at least :data:`WORTH_SAYING` of the texts hold an unknown word."""
        return self.holding > 0 and self.holding >= WORTH_SAYING * self.texts

    def describe(self) -> str:
        """``312 of the 4,375 training texts (7.1%) hold words the tokenizer reads as its unknown token [UNK]
        (1.2% of their tokens), most often "😂" (120 times) and "❤" (50)``."""
        share = f"{self.unknown / self.tokens:.1%}" if self.tokens else "none"
        said = (f"{self.holding:,} of the {self.texts:,} training texts ({self.holding / self.texts:.1%}) hold words "
                f"the tokenizer reads as its unknown token {self.unk_token} ({share} of their tokens)")
        if not self.commonest:
            return said
        words = [f"{_shown(word)!r} ({count:,} time{'s' if count != 1 else ''})" if not i else
                 f"{_shown(word)!r} ({count:,})" for i, (word, count) in enumerate(self.commonest)]
        listed = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
        return f"{said}, most often {listed}"

    def warning(self) -> str:
        """The run's one line: what is unknown, what it does to the model, and where to read what helps."""
        return (f"{self.describe()}: the model sees them all as one token and cannot tell them apart; a model "
                f"whose vocabulary has them reads them (for another language: one pretrained on it, or a "
                f"multilingual one; {DOCS})")

    def record(self) -> dict[str, Any]:
        """What ``metrics.json`` keeps (``train.unknown_words``), which :meth:`from_record` reads back."""
        return {"texts": self.texts, "holding": self.holding, "tokens": self.tokens, "unknown": self.unknown,
                "unk_token": self.unk_token, "commonest": [list(pair) for pair in self.commonest]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "UnknownWords":
        return cls(**{**record, "commonest": tuple((word, count) for word, count in record["commonest"])})


def card_lines(record: Optional[dict[str, Any]]) -> list[str]:
    """The model card's line on them, from ``metrics.json``'s record: none where the run did not warn (or a run
    of before that did not count them)."""
    found = UnknownWords.from_record(record) if record else None
    if found is None or not found.worth_saying:
        return []
    return [f"- Unknown words: {found.describe()}; the model read each as the same token, and reads them so in use"]


def count_unknown_words(tokenizer: Any, texts, tokenized) -> Optional[UnknownWords]:
    """Count the unknown tokens in the tokenized training split ``tokenized`` (``None`` for a tokenizer that has
    no unknown token), and name the commonest words from ``texts``, the same split's rows before tokenizing.

    ``tokenized`` holds one row per text of ``texts``, in their order (:func:`finetune.tokens.tokenize_splits`):
    the rows that hold an unknown token are found in the first, and their words read from the second.
    """
    unk, others = tokenizer.unk_token_id, _other_special_tokens(tokenizer)
    if unk is None or tokenizer.unk_token in others:
        # none, or one that has another role too (GPT-2's <|endoftext|> ends texts): it marks no word
        return None
    # a special token missing from the vocabulary reads as the unknown one: it is not left out of the count
    special = sorted({token for token in tokenizer.convert_tokens_to_ids(others) if token != unk})
    tokens, unknown, rows = _count(arrow_column(tokenized, "input_ids"), unk, special)
    return UnknownWords(texts=len(tokenized), holding=len(rows), tokens=tokens, unknown=unknown,
                        unk_token=str(tokenizer.unk_token), commonest=_commonest_words(tokenizer, texts, rows))


def say_unknown_words(found: Optional[UnknownWords]) -> None:
    """Warn when enough of the training texts hold unknown words (:attr:`UnknownWords.worth_saying`)."""
    if found is not None and found.worth_saying:
        logger.warning(found.warning())


def _other_special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens in every role but the unknown token's (a token may have several roles)."""
    others: list[str] = []
    for role, tokens in tokenizer.special_tokens_map.items():
        if role != "unk_token":
            others.extend([tokens] if isinstance(tokens, str) else tokens)
    return others


def _count(column, unk: int, special: Sequence[int]) -> tuple[int, int, list[int]]:
    """The text tokens of an ``input_ids`` column, how many are ``unk``, and the rows (in order) holding one; a
    chunk of the column at a time, in NumPy."""
    import numpy as np

    tokens = unknown = 0
    rows: list[np.ndarray] = []
    start = 0
    for chunk in getattr(column, "chunks", [column]):
        ids, row_of = _flattened(chunk)
        is_unknown = ids == unk
        tokens += int(ids.size - np.isin(ids, special).sum())
        unknown += int(is_unknown.sum())
        rows.append(np.unique(row_of[is_unknown]) + start)
        start += len(chunk)
    return tokens, unknown, [int(row) for part in rows for row in part]


def _flattened(chunk) -> tuple["np.ndarray", "np.ndarray"]:  # noqa: F821
    """The token ids of a chunk of list rows (lists of windows under ``chunks``) and the row each comes from."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    values, row_of = chunk, None
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        parents = pc.list_parent_indices(values).to_numpy()
        values = pc.list_flatten(values)
        row_of = parents if row_of is None else row_of[parents]
    if row_of is None:  # not a list column
        row_of = np.arange(len(values))
    return values.to_numpy(zero_copy_only=False), row_of


def _commonest_words(tokenizer: Any, texts, rows: list[int]) -> tuple[tuple[str, int], ...]:
    """The words the tokenizer reads as unknown in the first :data:`TEXTS_READ_FOR_WORDS` of ``rows`` of
    ``texts``, commonest first, from the characters each unknown token stands for (its offsets, which only fast
    tokenizers give: none is named for a slow one)."""
    from finetune.tables import TEXT, TEXT_PAIR  # with datasets: not at import, which the model card's readers make

    if not rows or not getattr(tokenizer, "is_fast", False):
        return ()
    sample = texts.select(rows[:TEXTS_READ_FOR_WORDS])
    found: Counter[str] = Counter()
    for column in (TEXT, TEXT_PAIR):
        if column not in sample.column_names:
            continue
        written = [str(text) for text in read_column(sample, column)]
        encoded = tokenizer(written, return_offsets_mapping=True, add_special_tokens=False, verbose=False)
        for text, ids, offsets in zip(written, encoded["input_ids"], encoded["offset_mapping"]):
            found.update(text[start:end] for token, (start, end) in zip(ids, offsets)
                         if token == tokenizer.unk_token_id and end > start)
    return tuple(found.most_common(WORDS_NAMED))


def _shown(word: str) -> str:
    return word if len(word) <= WORD_SHOWN else f"{word[:WORD_SHOWN - 1]}…"
