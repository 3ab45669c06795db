"""transformers' load report, held back where it says only what fine-tuning expects.

Loading a pretrained encoder under a new classification head makes
transformers report the head's weights as missing, in a table that ends
"Consider training on your downstream task": true, expected, and alarming
to read at the start of every run or prediction. A run names its new head
once in its own words (the start line); a LoRA checkpoint's head comes from
its adapter. Any other report (encoder weights missing, unexpected or of
another shape) is shown as transformers wrote it.
"""

from __future__ import annotations

import contextlib
import logging


def new_head_of(model, info: dict) -> tuple[tuple[str, ...], bool]:
    """The weights that start untrained outside the encoder (the head), and whether anything else was reported."""
    encoder = f"{model.base_model_prefix}."
    mismatched = {k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys") or ()}
    fresh = set(info.get("missing_keys") or ()) | mismatched
    head = tuple(sorted(k for k in fresh if not k.startswith(encoder)))
    other = len(fresh) > len(head) or bool(info.get("unexpected_keys")) or bool(info.get("error_msgs"))
    return head, other


@contextlib.contextmanager
def held_load_report():
    """Hold back transformers' load report while a model loads; yields the held records.

    Hand-written because transformers has no switch for the report alone: it
    is a WARNING record of ``transformers.modeling_utils`` whose text holds
    ``LOAD REPORT`` (transformers 5) or starts ``Some weights of`` (4.x: the
    weights newly initialised, or those of the checkpoint not used). Were that
    wording to change, the report would simply be shown, as without this.
    """
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if "LOAD REPORT" in text or text.startswith("Some weights of"):
            held.append(record)
            return False
        return True

    source = logging.getLogger("transformers.modeling_utils")
    source.addFilter(hold)
    try:
        yield held
    except BaseException:
        source.removeFilter(hold)
        show(held)  # a load that failed: the report may say why
        raise
    finally:
        source.removeFilter(hold)


def show(records: list[logging.LogRecord]) -> None:
    for record in records:
        logging.getLogger(record.name).handle(record)
