"""``data.truncation: chunks``: a long text as overlapping windows, with one output per text.

A chunked text is still *one sample*: one row of the tokenized split, one
index of the sampler, one label. Only the collator spreads it over several
rows of the model's input, one per window, and :func:`document_logits` folds
the windows' logits back into the text's. So everything that counts samples
(the sampler's windows of ``B``, which samples are real, the loss scale of an
update, resume, the evaluation's gather) counts texts, unchanged, and a text's
windows are always in one micro-batch, hence in one update.

The rule, the same in training, evaluation and prediction: **a text's output
is the mean of its windows' logits**, and its loss is the task's loss on that
output. So a window weighs ``1 / n`` in a text of ``n`` windows, every text
weighs ``1 / N`` in an update of ``N`` texts whatever its length, and the
training loss is the loss of what is predicted. The mean of logits rather
than of probabilities because it is one rule for every problem type (a
regression's output is its logit; multi-label's sigmoids and single-label's
softmax apply to the mean as to one window's logits) and because it is what
the loss is computed on.

transformers' collators pad rows, and its pipelines classify one window; the
spreading and the folding are written here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# the collated batch's map from texts to rows: [texts, most windows] row indices, -1 past a text's windows
CHUNK_ROWS = "chunk_rows"
# what a collated batch holds besides the model's inputs
NOT_MODEL_INPUTS = ("labels", CHUNK_ROWS)


class ChunkCollator:
    """Collate texts whose token lists are lists of windows: one padded row per window, one label per text.

    Args:
        pad: The collator of single rows (``DataCollatorWithPadding``, ``BucketPadding``).
    """

    def __init__(self, pad: Callable[[list], dict]):
        self.pad = pad

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        rows, spans = [], []
        windowed = [key for key in features[0] if key != "labels"]
        for feature in features:
            windows = len(feature["input_ids"])
            spans.append(range(len(rows), len(rows) + windows))
            rows += [{key: feature[key][w] for key in windowed} for w in range(windows)]
        batch = dict(self.pad(rows))
        most = max(len(span) for span in spans)
        batch[CHUNK_ROWS] = torch.tensor([[*span, *[-1] * (most - len(span))] for span in spans])
        if "labels" in features[0]:
            # as DataCollatorWithPadding makes them: integers as int64 (class ids), numbers as float32
            labels = [feature["labels"] for feature in features]
            batch["labels"] = torch.tensor(labels, dtype=torch.long if _integers(labels) else torch.float)
        return batch


def _integers(labels: list) -> bool:
    first = labels[0][0] if isinstance(labels[0], (list, tuple)) and labels[0] else labels[0]
    return isinstance(first, int) and not isinstance(first, bool)


def document_logits(logits: torch.Tensor, chunk_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """One row of logits per text: the mean of its windows' rows (``logits`` itself when nothing is chunked).

    A gather and a masked sum in float32: no host sync (the map's shape is
    known), the same arithmetic on every device, and a text of one window
    gets exactly its window's logits.
    """
    if chunk_rows is None:
        return logits
    present = chunk_rows >= 0
    windows = logits.float()[chunk_rows.clamp(min=0)]  # [texts, most windows, outputs]
    summed = torch.where(present.unsqueeze(-1), windows, torch.zeros_like(windows)).sum(dim=1)
    return summed / present.sum(dim=1, keepdim=True)


def tokens_per_text(attention_mask: torch.Tensor, chunk_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """The non-pad tokens of each text of a collated batch, its windows' together (overlaps counted twice)."""
    per_row = attention_mask.sum(dim=1)
    if chunk_rows is None:
        return per_row
    present = chunk_rows >= 0
    return torch.where(present, per_row[chunk_rows.clamp(min=0)], torch.zeros_like(chunk_rows)).sum(dim=1)


def split_batch(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """``(the model's inputs, the chunk map or None)`` of a collated batch, labels left out."""
    inputs = {key: value for key, value in batch.items() if key not in NOT_MODEL_INPUTS}
    return inputs, batch.get(CHUNK_ROWS)
