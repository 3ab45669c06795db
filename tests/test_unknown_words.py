"""Words the tokenizer reads as its unknown token: counted in the tokenized training split, each count equal to
the texts' own tokenizing, said when they are a pattern, kept in metrics.json and on the card."""

from __future__ import annotations

import logging
import random
from collections import Counter

import datasets
import pytest

from finetune.tables import LABELS, TEXT, TEXT_PAIR
from finetune.tokens import tokenize_splits
from finetune.truncation import Truncation
from finetune.unknown_words import WORTH_SAYING, UnknownWords, card_lines, count_unknown_words, say_unknown_words
from helpers import SPECIAL, WORDS, make_texts, save_tiny_model

# words outside the tiny vocabulary, each in a different number of texts, so that their order is decided
UNKNOWN = {"zebra": 6, "😂": 4, "qux": 2, "🙄": 1}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("tiny")))


def _texts(seed: int = 0) -> list[str]:
    """Texts of the tiny vocabulary's words, some with the unknown words spread among them (one twice)."""
    rng = random.Random(seed)
    texts = [text for _, text in make_texts(40, seed=seed)]
    for word, count in UNKNOWN.items():
        for i in rng.sample(range(len(texts)), count):
            words = texts[i].split()
            words.insert(rng.randrange(len(words) + 1), word)
            texts[i] = " ".join(words)
    texts[0] = f"{texts[0]} zebra zebra"  # two in one text: the text counts once, the tokens twice
    return texts


def _split(texts: list[str], pairs: list[str] | None = None) -> datasets.Dataset:
    columns = {TEXT: texts, LABELS: [i % 2 for i in range(len(texts))]}
    if pairs is not None:
        columns[TEXT_PAIR] = pairs
    return datasets.Dataset.from_dict(columns)


def _alone(tokenizer, texts: list[str]) -> tuple[int, int, int, Counter]:
    """What tokenizing each text alone gives: its text tokens, its unknown ones, the texts holding one, and the
    words (the tiny vocabulary is whole words, so a word outside it is a word read as unknown)."""
    known = set(SPECIAL + WORDS)
    tokens = unknown = holding = 0
    words: Counter = Counter()
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        tokens += len(ids) - 2
        unknown += ids.count(tokenizer.unk_token_id)
        holding += tokenizer.unk_token_id in ids
        words.update(word for word in text.split() if word not in known)
    return tokens, unknown, holding, words


def test_the_counts_are_those_of_each_text_tokenized_alone_in_a_carved_splits_order(tokenizer):
    texts = _texts()
    order = random.Random(1).sample(range(len(texts)), 30)  # a carve: rows picked out and reordered
    carved = _split(texts).select(order)
    tokenized = tokenize_splits(datasets.DatasetDict(train=carved), tokenizer, max_length=64)["train"]
    found = count_unknown_words(tokenizer, carved, tokenized)
    tokens, unknown, holding, words = _alone(tokenizer, [texts[i] for i in order])
    assert (found.texts, found.tokens, found.unknown, found.holding) == (30, tokens, unknown, holding)
    assert 0 < found.holding < found.unknown  # the carve kept some of them, and "zebra zebra" counts twice
    assert found.commonest == tuple(words.most_common(5)) and found.unk_token == "[UNK]"


def test_the_rows_of_a_split_of_several_arrow_chunks_are_the_splits_own(tokenizer):
    """A tokenized split of thousands of rows is held in chunks: a row found in a later one is still its row."""
    from finetune.columns import arrow_column

    texts = [text for _, text in make_texts(2500, seed=2)]
    for row, word in [(5, "zebra"), (1500, "qux"), (1700, "qux"), (2400, "😂")]:
        texts[row] = f"{texts[row]} {word}"
    split = _split(texts)
    tokenized = tokenize_splits(datasets.DatasetDict(train=split), tokenizer, max_length=64)["train"]
    assert len(arrow_column(tokenized, "input_ids").chunks) > 1  # what the test is about
    found = count_unknown_words(tokenizer, split, tokenized)
    assert found.holding == 4 and found.commonest == (("qux", 2), ("zebra", 1), ("😂", 1))


def test_a_pairs_second_text_is_counted_and_its_words_named(tokenizer):
    texts = _texts()
    pairs = [f"ok qux {i}" if i % 3 == 0 else "ok" for i in range(len(texts))]
    split = _split(texts, pairs)
    tokenized = tokenize_splits(datasets.DatasetDict(train=split), tokenizer, max_length=64)["train"]
    found = count_unknown_words(tokenizer, split, tokenized)
    alone = [tokenizer(text, pair)["input_ids"] for text, pair in zip(texts, pairs)]
    assert found.unknown == sum(ids.count(tokenizer.unk_token_id) for ids in alone)
    assert found.tokens == sum(len(ids) - 3 for ids in alone)  # [CLS] a [SEP] b [SEP]
    _, _, _, words = _alone(tokenizer, texts + pairs)
    assert dict(found.commonest) == {word: words[word] for word, _ in found.commonest}
    assert found.commonest[0][0] == "qux"  # in 14 pairs: the commonest now


def test_a_chunked_texts_windows_count_for_its_own_row(tokenizer):
    """Under chunks a row is a list of windows: the row the words are read from is still the text's."""
    texts = [" ".join(["ok"] * 30) for _ in range(12)]
    for i, word in [(2, "zebra"), (5, "😂"), (9, "zebra")]:
        texts[i] = f"{texts[i]} {word}"  # past the first window: only a row-of-window mix-up would miss it
    split = _split(texts)
    truncation = Truncation("chunks", 12, stride_tokens=2)
    tokenized = tokenize_splits(datasets.DatasetDict(train=split), tokenizer, 12, truncation=truncation)["train"]
    found = count_unknown_words(tokenizer, split, tokenized)
    assert found.holding == 3 and found.unknown == 3 and found.commonest == (("zebra", 2), ("😂", 1))
    assert found.tokens >= 12 * 30 + 3  # every token of every window, those two windows share counted twice


def test_a_special_token_the_vocabulary_lacks_is_not_taken_for_the_unknown_one(tokenizer):
    """A role given a token the vocabulary does not hold (a mask token named by hand) reads as the unknown token's
    id: the count is the same as without it."""
    import copy

    texts = _texts()
    split = _split(texts)
    tokenized = tokenize_splits(datasets.DatasetDict(train=split), tokenizer, max_length=64)["train"]
    lacking = copy.deepcopy(tokenizer)
    lacking.mask_token = "[NOT-IN-VOCAB]"
    assert lacking.convert_tokens_to_ids("[NOT-IN-VOCAB]") == lacking.unk_token_id
    assert count_unknown_words(lacking, split, tokenized) == count_unknown_words(tokenizer, split, tokenized)


def test_a_sentencepiece_tokenizers_unknown_pieces_are_counted_and_named(tmp_path):
    """DeBERTa-v3's kind: characters its pieces lack read as [UNK] (a run of them as one), the words around whole."""
    from transformers import AutoTokenizer

    from helpers import save_tiny_deberta_v3

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_deberta_v3(tmp_path / "deberta"))
    split = _split(["win cash now 😂", "hello see you 재미", "ok thanks"])
    tokenized = tokenize_splits(datasets.DatasetDict(train=split), tokenizer, max_length=32)["train"]
    found = count_unknown_words(tokenizer, split, tokenized)
    alone = [tokenizer(text)["input_ids"] for text in split[TEXT]]
    assert found.tokens == sum(len(ids) - 2 for ids in alone) and found.unknown == 2 and found.holding == 2
    assert found.commonest == (("😂", 1), ("재미", 1))


def test_a_tokenizer_without_an_unknown_token_counts_nothing(tmp_path):
    """Byte-level BPE has a token for every byte: there is no unknown token to count."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["ok see you later"] * 10, vocab_size=300, special_tokens=["<s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    split = _split(["ok 😂", "재미있는"])
    tokenized = tokenize_splits(datasets.DatasetDict(train=split), tokenizer, max_length=16)["train"]
    assert tokenizer.unk_token_id is None and count_unknown_words(tokenizer, split, tokenized) is None
    # GPT-2's way: its one special token is the unknown one too, and marks the texts' ends, not unknown words
    both = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<s>", eos_token="<s>")
    ended = datasets.Dataset.from_dict({"input_ids": [ids + [both.eos_token_id] for ids in tokenized["input_ids"]]})
    assert both.unk_token_id == both.eos_token_id and count_unknown_words(both, split, ended) is None


def test_the_default_models_tokenizer_reads_emojis_and_korean_as_unknown():
    """What docs/configuration.md says of the embedded MiniLM."""
    from finetune.config import load_config
    from finetune.modeling import load_tokenizer

    tokenizer = load_tokenizer(load_config("configs/default.yaml", []).model)
    texts = ["loved it 😂", "정말 재미있는 영화였어요", "café au lait", "so good ❤"]
    split = _split(texts)
    tokenized = tokenize_splits(datasets.DatasetDict(train=split), tokenizer, max_length=32)["train"]
    found = count_unknown_words(tokenizer, split, tokenized)
    assert found.holding == 3 and dict(found.commonest) == {"😂": 1, "재미있는": 1, "영화였어요": 1, "❤": 1}


@pytest.mark.parametrize("texts, holding, said", [(50, 1, True), (51, 1, False), (100, 2, True), (10, 0, False)])
def test_the_run_warns_from_one_text_in_fifty(caplog, texts, holding, said):
    assert WORTH_SAYING == 1 / 50
    found = UnknownWords(texts=texts, holding=holding, tokens=1000, unknown=holding, unk_token="[UNK]")
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        say_unknown_words(found)
    assert bool(caplog.records) is said and found.worth_saying is said
    assert (card_lines(found.record()) != []) is said


def test_the_warning_names_the_share_the_words_and_what_reads_them():
    thai = "ฉันชอบหนังเรื่องนี้มากเลยจริงๆ"  # a sentence without spaces: one word, shown cut to 24 characters
    found = UnknownWords(texts=4375, holding=312, tokens=101_000, unknown=1212, unk_token="[UNK]",
                         commonest=(("😂", 120), ("❤", 50), (thai, 1)))
    assert len(thai) > 24 and found.describe() == (
        "312 of the 4,375 training texts (7.1%) hold words the tokenizer reads as its unknown token [UNK] (1.2% of "
        f"their tokens), most often '😂' (120 times), '❤' (50) and '{thai[:23]}…' (1)")
    assert found.warning().endswith("docs/configuration.md#words-the-tokenizer-does-not-know)")
    assert UnknownWords.from_record(found.record()) == found
    assert card_lines(found.record()) == [f"- Unknown words: {found.describe()}; the model read each as the same "
                                          f"token, and reads them so in use"]
    assert card_lines(None) == []  # a run of before that did not count them


def test_a_run_says_it_and_keeps_it_in_metrics_and_on_the_card(tmp_path, caplog):
    from finetune import setup_run
    from finetune.config import load_config
    from finetune.model_card import model_card
    from finetune.results import summarize
    from tiny_run import reset_accelerate

    def write(path, rows):
        path.write_text("label,text\n" + "".join(f"{label},{text}\n" for label, text in rows), encoding="utf-8")
        return path

    rows = [(label, f"{text} zebra" if i % 4 == 0 else text) for i, (label, text) in enumerate(make_texts(60))]
    cfg = load_config(None, [f"data.train_file={write(tmp_path / 'train.csv', rows)}",
                             f"data.validation_file={write(tmp_path / 'dev.csv', make_texts(10, seed=1))}",
                             f"model.name_or_path={save_tiny_model(tmp_path / 'tiny')}", "data.max_length=32",
                             "training.mixed_precision=no", f"output.output_dir={tmp_path / 'out'}"])
    reset_accelerate()
    try:
        with caplog.at_level(logging.WARNING, logger="finetune.data"):
            run = setup_run(cfg)
        summary = summarize(run, history=[])
    finally:
        reset_accelerate()
    said = [r.getMessage() for r in caplog.records if "unknown token" in r.getMessage()]
    assert said == [run.unknown_words.warning()] and run.unknown_words.commonest == (("zebra", 15),)
    assert (run.unknown_words.holding, run.unknown_words.unknown, run.unknown_words.texts) == (15, 15, 60)
    assert summary["train"]["unknown_words"] == run.unknown_words.record()
    assert f"- Unknown words: {run.unknown_words.describe()};" in model_card(cfg, summary)
