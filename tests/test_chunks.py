"""data.truncation: chunks: windows of a long text, one output per text, in training, evaluation, prediction and resume.

The accumulation contract with chunked texts (``(8, 4)`` against ``(32, 1)``,
each text weighing the same) is tested with the others in test_accumulation.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.chunks import CHUNK_ROWS, ChunkCollator, document_logits, split_batch, tokens_per_text
from finetune.config import DataConfig
from finetune.errors import ConfigError
from finetune.truncation import Truncation, long_texts
from helpers import SPECIAL, WORDS

CLS, SEP = SPECIAL.index("[CLS]"), SPECIAL.index("[SEP]")


def _text(n: int) -> tuple[str, list[int]]:
    """A text of ``n`` words, each one token, and its content ids."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(n)), [len(SPECIAL) + i % len(WORDS) for i in range(n)]


# --------------------------------------------------------------------------- the windows


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_a_long_text_becomes_overlapping_windows_each_with_the_special_tokens(tokenizers, kind):
    text, content = _text(40)
    encoded = Truncation("chunks", max_length=16, stride_tokens=4).encode(tokenizers[kind], [text])
    # 14 text tokens a window, a new window every 10: 0-14, 10-24, 20-34, 30-40
    assert encoded["input_ids"] == [[[CLS, *content[start:start + 14], SEP] for start in (0, 10, 20, 30)]]
    assert encoded["attention_mask"] == [[[1] * 16] * 3 + [[1] * 12]]
    assert encoded["chunks"] == [4] and encoded["full_length"] == [42]
    assert encoded["length"] == [4 * 16]  # the windows pad to the first: what the text costs in a micro-batch


def test_a_text_that_fits_is_one_window_as_the_tokenizer_makes_it(tokenizers):
    tokenizer = tokenizers["fast"]
    texts = [_text(n)[0] for n in (0, 3, 14)]  # 14 words + 2 special tokens = the window exactly
    encoded = Truncation("chunks", max_length=16).encode(tokenizer, texts)
    whole = tokenizer(texts)
    for key in whole:
        assert encoded[key] == [[row] for row in whole[key]], key
    assert encoded["chunks"] == [1, 1, 1] and encoded["length"] == [2, 5, 16]


@pytest.mark.parametrize("words, stride", [(15, 0), (15, 13), (23, 5), (24, 5), (25, 5), (97, 3), (60, 12)])
def test_windows_cover_every_token_once_in_order_and_neighbours_share_exactly_the_stride(tokenizers, words, stride):
    text, content = _text(words)
    windows = Truncation("chunks", max_length=16, stride_tokens=stride).encode(tokenizers["fast"], [text])
    windows = [w[1:-1] for w in windows["input_ids"][0]]
    assert all(len(w) == 14 for w in windows[:-1]) and 0 < len(windows[-1]) <= 14
    step = 14 - stride
    assert [w for i, window in enumerate(windows) for w in window[stride if i else 0:]] == content
    assert all(windows[i][-stride:] == windows[i + 1][:stride] for i in range(len(windows) - 1) if stride)
    assert len(windows) == 1 + -(-(words - 14) // step)  # no window more than the end needs


@pytest.mark.parametrize("stride", [0, 4, 13])
def test_a_fast_tokenizers_overflowing_windows_are_the_same_as_docs_long_texts_says(tokenizers, stride):
    """docs/long_texts.md tells pipeline users to split with return_overflowing_tokens: it must make these windows."""
    tokenizer = tokenizers["fast"]
    for words in (3, 14, 15, 29, 40, 77):
        text = _text(words)[0] + " unbelievable"  # and a word outside the vocabulary: [UNK]
        ours = Truncation("chunks", max_length=16, stride_tokens=stride).encode(tokenizer, [text])["input_ids"][0]
        theirs = tokenizer(text, truncation=True, max_length=16, stride=stride, return_overflowing_tokens=True)
        assert ours == theirs["input_ids"], words


def test_the_default_stride_is_a_quarter_of_the_window():
    assert Truncation("chunks", max_length=512).stride == 128
    assert Truncation("chunks", max_length=512).describe() == "windows overlapping by 128 tokens"


@pytest.mark.parametrize("overrides, message", [
    ({"stride": 8}, "data.stride: applies to data.truncation: chunks, not head"),
    ({"truncation": "chunks", "stride": 128}, "data.stride: must be >= 0 and smaller than data.max_length (128), "
                                              "got 128"),
    ({"truncation": "chunks", "stride": -1}, "data.stride: must be >= 0"),
    ({"truncation": "chunks", "text_pair_column": "b"}, "data.truncation: chunks cuts single texts; with "
                                                        "data.text_pair_column only head is supported"),
])
def test_bad_chunk_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}"):
        DataConfig(train_file="x.csv", **overrides)


def test_a_stride_that_leaves_a_window_no_new_token_names_the_key(tokenizers):
    # smaller than max_length, but a window holds 14 text tokens besides [CLS] and [SEP]
    with pytest.raises(ConfigError, match=r"^data.stride: 14 leaves a window no new token: a window holds 14 text "
                                          r"tokens \(data.max_length 16 less 2 special\); use a stride below 14$"):
        Truncation("chunks", max_length=16, stride_tokens=14).encode(tokenizers["fast"], [_text(40)[0]])


def test_the_tokens_cache_keeps_each_stride_apart(tokenizers):
    import datasets

    from finetune.tokens import tokenized_cache_key

    split = datasets.Dataset.from_dict({"text": [_text(40)[0]], "labels": [0]})
    keys = {tokenized_cache_key(split, tokenizers["fast"], 16, truncation) for truncation in (
        Truncation("head", 16), Truncation("chunks", 16), Truncation("chunks", 16, stride_tokens=2))}
    assert len(keys) == 3


def test_long_texts_counts_the_windows(tokenizers):
    import datasets

    truncation = Truncation("chunks", max_length=16, stride_tokens=4)
    split = datasets.Dataset.from_dict(truncation.encode(tokenizers["fast"], [_text(n)[0] for n in (3, 14, 15, 40)]))
    counted = long_texts(split, truncation)
    assert (counted.rows, counted.longer, counted.longest, counted.chunks) == (4, 2, 42, 1 + 1 + 2 + 4)
    assert counted.describe() == "2 longer than 16 tokens, up to 42: split into windows overlapping by 4 tokens " \
                                 "(8 windows in all)"
    assert counted.record()["chunks"] == 8


# --------------------------------------------------------------------------- collating and folding back


def _pad(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


@pytest.mark.parametrize("labels, dtype", [([1, 0, 2], torch.long), ([0.5, -1.0, 2.0], torch.float),
                                           ([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], torch.float)])
def test_the_collator_makes_a_row_per_window_and_keeps_a_label_per_text(labels, dtype):
    texts = [{"input_ids": [[2, 7, 3]], "labels": labels[0]},
             {"input_ids": [[2, 8, 9, 3], [2, 9, 10, 3], [2, 11, 3]], "labels": labels[1]},
             {"input_ids": [[2, 12, 13, 14, 3], [2, 14, 3]], "labels": labels[2]}]
    batch = ChunkCollator(_pad)(texts)
    assert batch["input_ids"].shape == (6, 5)
    assert batch[CHUNK_ROWS].tolist() == [[0, -1, -1], [1, 2, 3], [4, 5, -1]]
    assert batch["labels"].dtype == dtype and batch["labels"].tolist() == labels
    assert tokens_per_text(batch["attention_mask"], batch[CHUNK_ROWS]).tolist() == [3, 4 + 4 + 3, 5 + 3]
    inputs, chunk_rows = split_batch(batch)
    assert set(inputs) == {"input_ids", "attention_mask"} and chunk_rows is batch[CHUNK_ROWS]


def test_a_texts_output_is_the_mean_of_its_windows_logits_and_one_window_is_itself():
    logits = torch.randn(6, 3, dtype=torch.bfloat16)
    rows = torch.tensor([[0, -1, -1], [1, 2, 3], [4, 5, -1]])
    folded = document_logits(logits, rows)
    assert folded.dtype == torch.float32 and folded.shape == (3, 3)
    assert torch.equal(folded[0], logits[0].float())
    torch.testing.assert_close(folded[1], logits[1:4].float().mean(0))
    torch.testing.assert_close(folded[2], logits[4:6].float().mean(0))
    assert document_logits(logits, None) is logits


# --------------------------------------------------------------------------- a chunked run, end to end


@pytest.fixture(scope="module")
def chunk_runs(tmp_path_factory):
    """A chunked run to its end, and the same run stopped after update 3 (mid-epoch) and resumed."""
    from finetune.start_line import describe
    from tiny_run import fit_tiny_run

    sections = {"model": {"dropout": 0.1},  # the random states are restored on resume
                "data": {"max_length": 10, "truncation": "chunks", "stride": 2},
                "output": {"checkpoint_every": 3, "keep_last": None}}
    whole_root, part_root = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("part")
    lines = []
    whole = fit_tiny_run(whole_root, before_fit=lambda run: lines.append(describe(run)), **sections)
    stopped = fit_tiny_run(part_root, on_update=lambda state: state.step >= 3, **sections)
    resumed = fit_tiny_run(part_root, **{**sections, "output": {**sections["output"], "resume_from": "latest"}})
    return SimpleNamespace(whole=whole, stopped=stopped, resumed=resumed, start_line=lines[0],
                           out=Path(whole[0].output.output_dir), part=Path(resumed[0].output.output_dir))


@pytest.mark.slow
def test_a_chunked_run_counts_texts_and_says_what_it_split(chunk_runs):
    cfg, summary = chunk_runs.whole
    record = summary["train"]["long_texts"]
    assert record["rows"] == 150 and 0 < record["longer_than_max_length"] < 150
    assert record["chunks"] > 150 + record["longer_than_max_length"] - 1  # every long text has 2 windows or more
    assert (f"{record['longer_than_max_length']} longer than 10 tokens, up to {record['longest_tokens']}: split "
            f"into windows overlapping by 2 tokens ({record['chunks']} windows in all)") in chunk_runs.start_line
    # the memory plan counts its rows in windows: the longest micro-batch's texts make more than one each
    plan = summary["memory_plan"]
    assert plan["windows"] > plan["micro_batch"] > 1
    assert f"at b={plan['micro_batch']} texts in {plan['windows']} windows x " in chunk_runs.start_line
    # samples are texts: 150 a epoch, 2 epochs; the evaluation counts the 40 validation texts
    assert summary["train"]["samples"] == 300
    assert summary["eval"]["num_samples"] == 40
    card = (chunk_runs.out / "README.md").read_text()
    assert "were split into windows overlapping by 2 tokens" in card and "mean of its windows' logits" in card


@pytest.mark.slow
def test_a_resumed_chunked_run_ends_bitwise_equal_to_the_uninterrupted_one(chunk_runs):
    assert chunk_runs.stopped[1]["train"]["ended"] == "stopped_by_caller"
    whole, part = chunk_runs.out, chunk_runs.part
    assert (part / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (whole, part)]
    for m in metrics:
        m["train"].pop("seconds")
        m["train"].pop("data_file")  # the same rows, written into each run's own folder
        m["memory_plan"].pop("available")  # the machine's, at each start
    assert metrics[0] == metrics[1]


@pytest.mark.slow
def test_prediction_gives_one_row_per_text_the_mean_of_its_windows(chunk_runs, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.predict import Predictor, main

    out = chunk_runs.out
    predictor = Predictor.load(out)
    assert predictor.truncation == Truncation("chunks", 10, stride_tokens=2)
    texts = [_text(n)[0] for n in (3, 8, 9, 30)]  # 1, 1, 2 and 4 windows of 8 text tokens every 6
    logits = predictor.logits(texts)
    assert logits.shape == (4, 2)
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    for text, row in zip(texts, logits):
        ids = tokenizer(text)["input_ids"][1:-1]
        windows = [[CLS, *ids[start:start + 8], SEP] for start in range(0, max(1, len(ids) - 2), 6)]
        with torch.no_grad():
            each = torch.cat([model(input_ids=torch.tensor([w])).logits for w in windows])
        torch.testing.assert_close(torch.from_numpy(row), each.mean(0), rtol=1e-5, atol=1e-6)

    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main([str(out), "--file", str(data), "--output", str(tmp_path / "predicted.jsonl")]) == 0
    assert len((tmp_path / "predicted.jsonl").read_text().splitlines()) == 4  # one row per text
