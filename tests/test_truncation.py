"""data.truncation: what a text longer than max_length keeps, in training, the tokens cache, prediction and the report."""

from __future__ import annotations

import csv
import json

import pytest

from finetune.config import DataConfig
from finetune.errors import ConfigError
from finetune.truncation import Truncation, long_texts
from helpers import SPECIAL, WORDS, make_texts, run_cli, save_tiny_model

CLS, SEP = SPECIAL.index("[CLS]"), SPECIAL.index("[SEP]")


def _text(n: int) -> tuple[str, list[int]]:
    """A text of ``n`` words, each one token, and its content ids (every word differs from its neighbours)."""
    words = [WORDS[i % len(WORDS)] for i in range(n)]
    return " ".join(words), [len(SPECIAL) + i % len(WORDS) for i in range(n)]


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_head_tail_keeps_exactly_the_head_and_tail_tokens_asked_for_around_the_special_tokens(tokenizers, kind):
    tokenizer = tokenizers[kind]
    text, content = _text(40)
    encoded = Truncation("head_tail", max_length=16, head_tokens=5).encode(tokenizer, [text])
    # 16 = [CLS] + 5 from the start + 9 from the end + [SEP]
    assert encoded["input_ids"] == [[CLS, *content[:5], *content[-9:], SEP]]
    assert encoded["attention_mask"] == [[1] * 16]
    assert encoded["length"] == [16] and encoded["full_length"] == [42]
    if "token_type_ids" in encoded:
        assert encoded["token_type_ids"] == [[0] * 16]


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_tail_keeps_the_last_tokens_and_head_is_the_tokenizers_own_cut(tokenizers, kind):
    tokenizer = tokenizers[kind]
    text, content = _text(40)
    assert Truncation("tail", max_length=10).encode(tokenizer, [text])["input_ids"] == [[CLS, *content[-8:], SEP]]
    head = Truncation("head", max_length=10).encode(tokenizer, [text])
    assert head["input_ids"] == [tokenizer(text, truncation=True, max_length=10)["input_ids"]]


@pytest.mark.parametrize("side", ["head", "tail", "head_tail"])
def test_a_text_that_fits_comes_out_as_the_tokenizer_makes_it(tokenizers, side):
    tokenizer = tokenizers["fast"]
    texts = [_text(n)[0] for n in (0, 3, 14)]  # 14 words + 2 special tokens = the window exactly
    encoded = Truncation(side, max_length=16, head_tokens=4 if side == "head_tail" else None).encode(tokenizer, texts)
    whole = tokenizer(texts)
    for key in whole:
        assert encoded[key] == whole[key], key
    assert encoded["length"] == encoded["full_length"] == [2, 5, 16]


def test_the_default_head_is_a_quarter_of_the_window():
    assert Truncation("head_tail", max_length=512).head == 128
    assert Truncation("head_tail", max_length=512, head_tokens=0).head == 0


def test_a_text_pair_is_cut_by_the_tokenizer_and_only_at_its_head(tokenizers):
    tokenizer = tokenizers["fast"]
    first, second = _text(30)[0], _text(3)[0]
    encoded = Truncation("head", max_length=12).encode(tokenizer, [first], [second])
    assert encoded["input_ids"] == [tokenizer(first, second, truncation=True, max_length=12)["input_ids"]]
    assert encoded["full_length"] == [36]
    with pytest.raises(ConfigError, match="^data.truncation: head_tail cuts single texts; with data.text_pair_column"):
        Truncation("head_tail", max_length=12).encode(tokenizer, [first], [second])


def test_the_tokens_cache_keeps_each_cut_apart(tokenizers):
    import datasets

    from finetune.tokens import tokenized_cache_key

    split = datasets.Dataset.from_dict({"text": [_text(40)[0]], "labels": [0]})
    tokenizer = tokenizers["fast"]
    keys = {tokenized_cache_key(split, tokenizer, 16, truncation) for truncation in (
        None, Truncation("head", 16), Truncation("tail", 16), Truncation("head_tail", 16),
        Truncation("head_tail", 16, head_tokens=2))}
    assert len(keys) == 4  # None is head's key


def test_long_texts_counts_what_the_window_cut(tokenizers):
    import datasets

    texts = [_text(n)[0] for n in (3, 14, 15, 40)]
    truncation = Truncation("head_tail", max_length=16, head_tokens=4)
    split = datasets.Dataset.from_dict(truncation.encode(tokenizers["fast"], texts))
    counted = long_texts(split, truncation)
    assert (counted.rows, counted.longer, counted.longest) == (4, 2, 42)
    assert counted.describe() == "2 longer than 16 tokens, up to 42: kept their first 4 and last tokens"
    assert long_texts(split, Truncation("head", max_length=64)).describe() == ""


@pytest.mark.parametrize("overrides, message", [
    ({"truncation": "middle"}, None),  # the schema's one-of check, tested with the other keys' errors
    ({"truncation": "tail", "text_pair_column": "b"}, "data.truncation: tail cuts single texts; with "
                                                       "data.text_pair_column only head is supported"),
    ({"head_tokens": 8}, "data.head_tokens: applies to data.truncation: head_tail, not head"),
    ({"truncation": "head_tail", "head_tokens": 128}, "data.head_tokens: must be >= 0 and smaller than "
                                                      "data.max_length (128), got 128"),
    ({"truncation": "head_tail", "head_tokens": -1}, "data.head_tokens: must be >= 0"),
])
def test_bad_truncation_settings_are_refused_in_one_line(overrides, message):
    if message is None:
        with pytest.raises(ValueError, match="truncation must be one of head, tail, head_tail"):
            Truncation(overrides["truncation"], 16)
        return
    with pytest.raises(ConfigError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}"):
        DataConfig(train_file="x.csv", **overrides)


@pytest.fixture(scope="module")
def head_tail_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("head_tail")
    model = save_tiny_model(root / "tiny-bert")
    data = root / "train.csv"
    with open(data, "w", encoding="utf-8", newline="") as fh:
        csv.writer(fh).writerows([("label", "text"), *make_texts(60, seed=4)])
    out = root / "out"
    proc = run_cli(["--data", str(data), "--output", str(out), f"model.name_or_path={model}",
                    "training.max_steps=2", "data.max_length=8", "data.truncation=head_tail", "data.head_tokens=2",
                    "training.mixed_precision=no", "logging.progress_bar=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


@pytest.mark.slow
def test_a_head_tail_run_says_what_it_cut_and_predicts_with_the_same_cut(head_tail_run, tokenizers):
    from finetune.predict import Predictor

    out, stderr = head_tail_run
    record = json.loads((out / "metrics.json").read_text())["train"]["long_texts"]
    start = next(line for line in stderr.splitlines() if "start: " in line)
    assert f"{record['longer_than_max_length']} longer than 8 tokens, up to {record['longest_tokens']}: kept their " \
           f"first 2 and last tokens" in start
    assert 0 < record["longer_than_max_length"] <= record["rows"] == 54 and record["truncation"] == "head_tail"
    assert "kept their first 2 and last tokens (`data.truncation: head_tail`)" in (out / "README.md").read_text()

    predictor = Predictor.load(out)
    assert predictor.truncation == Truncation("head_tail", 8, 2)
    _sees_first_2_and_last_words(predictor)


def _sees_first_2_and_last_words(predictor) -> None:
    """A head_tail predictor of 8 tokens, 2 of the head, sees [CLS], the first 2 words, the last 4 and [SEP]:
    only those words change its output."""
    import numpy as np

    text, _ = _text(20)
    changed_middle = " ".join([*text.split()[:2], *["ok"] * 14, *text.split()[-4:]])
    changed_end = " ".join([*text.split()[:-1], "ok"])
    # one text per call: rows of one batch may take different matmul kernel paths (oneDNN's AMX tiles),
    # which differ in the last bit; a batch of one with the same ids is bitwise the same computation
    logits, middle, end = (predictor.logits([one])[0] for one in (text, changed_middle, changed_end))
    np.testing.assert_array_equal(logits, middle)
    assert not np.array_equal(logits, end)


def test_a_predictor_of_a_run_in_memory_cuts_and_pads_as_the_run_does(tmp_path):
    import numpy as np

    from finetune.assembly import setup_run
    from finetune.config import load_config
    from finetune.predict import Predictor
    from tiny_run import reset_accelerate

    data = tmp_path / "train.csv"
    with open(data, "w", encoding="utf-8", newline="") as fh:
        csv.writer(fh).writerows([("label", "text"), *make_texts(40, seed=4)])
    reset_accelerate()
    cfg = load_config(None, [f"model.name_or_path={save_tiny_model(tmp_path / 'tiny-bert')}",
                             f"data.train_file={data}", "data.max_length=8", "data.truncation=head_tail",
                             "data.head_tokens=2", "data.pad_to_multiple_of=4", "training.mixed_precision=no",
                             f"output.output_dir={tmp_path / 'out'}"])
    run = setup_run(cfg)
    predictor = Predictor.of_run(run, batch_size=2)
    assert predictor.model is run.accelerator.unwrap_model(run.model) and predictor.batch_size == 2
    assert (predictor.truncation, predictor.pad_to_multiple_of) == (Truncation("head_tail", 8, 2), 4)
    _sees_first_2_and_last_words(predictor)
    # a predictor made by hand cuts at the head: the end is not seen
    by_hand = Predictor(predictor.model, run.tokenizer, max_length=8)
    text, _ = _text(20)
    changed_end = " ".join([*text.split()[:-1], "ok"])
    np.testing.assert_array_equal(by_hand.logits([text])[0], by_hand.logits([changed_end])[0])


def test_deberta_v3_trains_and_predicts_past_its_512_positions(tmp_path):
    # DeBERTa-v3 as the Hub has it: relative positions only (position_biased_input: false) and a tokenizer
    # that is a SentencePiece model alone. data.max_length may exceed max_position_embeddings (64 here, 512
    # there), and the tokenizer's model_max_length (the same) must not cut the run's texts at prediction
    import random

    import numpy as np
    import torch

    from finetune.config import ModelConfig
    from finetune.errors import ModelError
    from finetune.modeling import load_model_config
    from finetune.predict import Predictor
    from helpers import save_tiny_deberta_v3
    from tiny_run import fit_tiny_run

    model_dir = save_tiny_deberta_v3(tmp_path / "tiny-deberta-v3", max_positions=64)
    assert load_model_config(ModelConfig(name_or_path=str(model_dir)), max_length=200).position_biased_input is False
    absolute = load_model_config(ModelConfig(name_or_path=str(model_dir)))
    absolute.position_biased_input = True  # absolute positions: 64 is a limit again
    absolute.save_pretrained(tmp_path / "absolute")
    with pytest.raises(ModelError, match="data.max_length: 200 exceeds the position limit 64"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "absolute")), max_length=200)

    rng = random.Random(0)
    rows = [(label, " ".join(rng.choice(WORDS[:10] if label == "spam" else WORDS[10:]) for _ in range(rng.randint(40, 60))))
            for label in ("spam", "ham") * 20]
    train = tmp_path / "long.tsv"
    train.write_text("".join(f"{label}\t{text}\n" for label, text in rows), encoding="utf-8")
    cfg, summary = fit_tiny_run(tmp_path, model={"name_or_path": str(model_dir)},
                                data={"train_file": str(train), "validation_file": str(train), "max_length": 200},
                                training={"num_train_epochs": 1})
    cut = summary["train"]["long_texts"]
    assert cut["longer_than_max_length"] == 0 and cut["longest_tokens"] > 64  # past the positions, none cut
    predictor = Predictor.load(cfg.output.output_dir)
    assert type(predictor.tokenizer).__name__.startswith("DebertaV2Tokenizer") and predictor.max_length == 200
    text = max((text for _, text in rows), key=len)
    ids = predictor.tokenizer(text, return_tensors="pt")
    assert ids["input_ids"].shape[1] > 64
    with torch.no_grad():
        whole = predictor.model(**ids).logits[0].numpy()
    np.testing.assert_allclose(predictor.logits([text])[0], whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type, limit", [("roberta", 62), ("xlm-roberta", 62), ("camembert", 62),
                                               ("data2vec-text", 62), ("mpnet", 62), ("bert", 64), ("electra", 64)])
def test_the_position_limit_is_what_the_model_runs(tmp_path, model_type, limit):
    # RoBERTa's kin number positions from the padding id + 1: 64 position embeddings take 62 tokens, as
    # roberta-base's 514 take 512. The limit is checked against the model itself, one token past it failing.
    import torch

    from finetune.config import ModelConfig
    from finetune.errors import ModelError
    from finetune.modeling import load_model_config
    from helpers import tiny_model

    model = tiny_model(model_type).eval()
    model(input_ids=torch.full((1, limit), 7))
    with pytest.raises((IndexError, RuntimeError)):
        model(input_ids=torch.full((1, limit + 1), 7))
    model.config.save_pretrained(tmp_path)
    assert load_model_config(ModelConfig(name_or_path=str(tmp_path)), max_length=limit) is not None
    with pytest.raises(ModelError, match=f"data.max_length: {limit + 1} exceeds the position limit {limit} "):
        load_model_config(ModelConfig(name_or_path=str(tmp_path)), max_length=limit + 1)
