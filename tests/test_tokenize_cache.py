"""The tokenized-split cache: same tokens as tokenizing, read back when (and only when) nothing changed.

A cache that returned stale tokens would silently train on the wrong inputs,
so most tests here are about the key: every input the tokens depend on must
change it, and it must not change between processes for the same inputs.
"""

from __future__ import annotations

import subprocess
import sys

import datasets
import pytest

from finetune.data import load_splits
from finetune.tokens import default_cache_dir, tokenize_splits, tokenized_cache_key
from finetune.config import DataConfig
from finetune.errors import ConfigError
from helpers import REPO, make_texts, offline_env, save_tiny_model, tsv_train_file, write_tsv


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokcache")
    model = save_tiny_model(root / "tiny-bert")
    data = write_tsv(root / "train.tsv", make_texts(60, seed=3))
    return {"root": root, "model": model, "data": data}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["model"])


def splits_of(path, seed: int = 0) -> datasets.DatasetDict:
    cfg = DataConfig(train_file=str(path), format="tsv", has_header=False, column_names=["label", "text"],
                     validation_split=0.2)
    return load_splits(cfg, seed=seed)[0]


def rows(ds: datasets.Dataset) -> dict[str, list]:
    return {column: ds[column] for column in ds.column_names}


def test_cached_tokens_equal_fresh_tokens_and_are_read_back(tiny, tokenizer, tmp_path):
    splits = splits_of(tiny["data"])
    fresh = tokenize_splits(splits, tokenizer, max_length=16)
    first = tokenize_splits(splits, tokenizer, max_length=16, cache_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.glob("*.arrow"))
    assert len(files) == 2  # one per split, named by its key
    for name in ("train", "validation"):
        assert rows(first[name]) == rows(fresh[name])
        assert first[name].cache_files[0]["filename"] == str(tmp_path / f"{tokenized_cache_key(splits[name], tokenizer, 16)}.arrow")

    # Prove the second call reads the file instead of tokenizing again: put other (valid)
    # tokens under the train split's name, and the second call must return those.
    other = tokenize_splits(splits_of(write_tsv(tmp_path / "other.tsv", make_texts(60, seed=99))), tokenizer, 16,
                            cache_dir=tmp_path / "other")
    train_file = first["train"].cache_files[0]["filename"]
    (tmp_path / "planted.arrow").write_bytes(open(other["train"].cache_files[0]["filename"], "rb").read())
    del first
    (tmp_path / "planted.arrow").replace(train_file)
    second = tokenize_splits(splits, tokenizer, max_length=16, cache_dir=tmp_path)
    assert rows(second["train"]) == rows(other["train"]) != rows(fresh["train"])
    assert rows(second["validation"]) == rows(fresh["validation"])
    assert sorted(p.name for p in tmp_path.glob("*.arrow")) == files  # nothing new written


def test_key_changes_with_everything_the_tokens_depend_on(tiny, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    split = splits_of(tiny["data"])["train"]
    base = tokenized_cache_key(split, tokenizer, 16)
    assert tokenized_cache_key(split, tokenizer, 16) == base  # deterministic

    texts = split["text"]
    edited = split.map(lambda row, i: {"text": texts[i] + (" win" if i == 7 else "")}, with_indices=True)
    relabelled = split.map(lambda row, i: {"labels": 1 - row["labels"] if i == 3 else row["labels"]},
                           with_indices=True)
    reordered = split.select([1, 0] + list(range(2, len(split))))
    fewer = split.select(range(len(split) - 1))

    lower = AutoTokenizer.from_pretrained(tiny["model"])
    left = AutoTokenizer.from_pretrained(tiny["model"], truncation_side="left")
    bigger_vocab = AutoTokenizer.from_pretrained(tiny["model"])
    bigger_vocab.add_tokens(["brandnewword"])
    no_types = AutoTokenizer.from_pretrained(tiny["model"], model_input_names=["input_ids", "attention_mask"])

    keys = {
        "text": tokenized_cache_key(edited, tokenizer, 16),
        "label": tokenized_cache_key(relabelled, tokenizer, 16),
        "order": tokenized_cache_key(reordered, tokenizer, 16),
        "rows": tokenized_cache_key(fewer, tokenizer, 16),
        "max_length": tokenized_cache_key(split, tokenizer, 17),
        "truncation_side": tokenized_cache_key(split, left, 16),
        "vocabulary": tokenized_cache_key(split, bigger_vocab, 16),
        "model_input_names": tokenized_cache_key(split, no_types, 16),
    }
    assert tokenized_cache_key(split, lower, 16) == base  # the same tokenizer loaded again
    assert base not in keys.values()
    assert len(set(keys.values())) == len(keys), keys


def test_key_ignores_the_truncation_state_a_call_leaves_behind(tiny, tokenizer):
    from transformers import AutoTokenizer

    split = splits_of(tiny["data"])["train"]
    unused = AutoTokenizer.from_pretrained(tiny["model"])
    before = tokenized_cache_key(split, unused, 16)
    unused(["free cash now"] * 3, truncation=True, max_length=4, padding="max_length")
    assert tokenized_cache_key(split, unused, 16) == before


def test_key_is_the_same_in_another_process(tiny, tokenizer):
    """What makes a rerun hit the cache: the key does not depend on the process that computes it."""
    split = splits_of(tiny["data"])["train"]
    script = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from transformers import AutoTokenizer\n"
        "from finetune.tokens import tokenized_cache_key\n"
        "from test_tokenize_cache import splits_of\n"
        f"split = splits_of({str(tiny['data'])!r})['train']\n"
        f"print(tokenized_cache_key(split, AutoTokenizer.from_pretrained({str(tiny['model'])!r}), 16))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=offline_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == tokenized_cache_key(split, tokenizer, 16)


def test_tokenizer_without_a_definition_is_not_cached(tiny, tokenizer, tmp_path):
    """A tokenizer with no ``backend_tokenizer`` (a pure-Python one) has nothing stable to key by."""

    class PythonTokenizer:
        def __call__(self, texts, pairs=None, **kwargs):
            return tokenizer(texts, pairs, **kwargs)

    splits = splits_of(tiny["data"])
    out = tokenize_splits(splits, PythonTokenizer(), 16, cache_dir=tmp_path)
    assert rows(out["train"]) == rows(tokenize_splits(splits, tokenizer, 16)["train"])
    assert tokenized_cache_key(splits["train"], PythonTokenizer(), 16) is None
    assert not list(tmp_path.glob("*.arrow"))


def test_unwritable_cache_dir_is_one_config_error(tiny, tokenizer, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^data\.cache_dir: cannot write tokenized splits to .*a-file/cache"):
        tokenize_splits(splits_of(tiny["data"]), tokenizer, 16, cache_dir=blocker / "cache")


def test_default_location_is_inside_the_datasets_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "finetune-tokenized"


def test_runs_cache_by_default_and_not_when_off(tiny, tmp_path, fresh_accelerate_state):
    """``setup_run`` caches in ``data.cache_dir``; a second run reads it; ``cache_tokenized: false`` writes nothing."""
    from finetune.config import load_config
    from finetune.assembly import setup_run

    def run_with(*overrides):
        cfg = load_config(REPO / "configs" / "default.yaml", [
            f"model.name_or_path={tiny['model']}", tsv_train_file(tiny["data"]), "data.max_length=16",
            "training.per_device_train_batch_size=4", "training.effective_batch_size=8",
            f"output.output_dir={tmp_path / 'out'}", *overrides,
        ])
        return setup_run(cfg)

    cached = run_with(f"data.cache_dir={tmp_path / 'cache'}")
    files = sorted((tmp_path / "cache").glob("*.arrow"))
    assert len(files) == 2
    first_batch = next(iter(cached.train_dataloader))
    datasets_file = cached.train_dataloader.dataset.cache_files[0]["filename"]
    assert datasets_file in {str(f) for f in files}

    fresh_accelerate_state_reset()
    again = run_with(f"data.cache_dir={tmp_path / 'cache'}")
    assert sorted((tmp_path / "cache").glob("*.arrow")) == files
    fresh_accelerate_state_reset()
    off = run_with(f"data.cache_dir={tmp_path / 'off'}", "data.cache_tokenized=false")
    assert not (tmp_path / "off").exists()
    assert not any(str(tmp_path) in f["filename"] for f in off.train_dataloader.dataset.cache_files)
    for other in (again, off):
        batch = next(iter(other.train_dataloader))
        assert all((batch[key] == first_batch[key]).all() for key in first_batch)


def test_a_run_reads_its_training_rows_once_for_the_resume_check_and_the_cache_key(tiny, tmp_path, monkeypatch,
                                                                                   fresh_accelerate_state):
    """The training split's content digest, which a checkpoint keeps to check a resume against, is the cache
    key's digest of its rows too: ``setup_run`` reads the split's rows for it once (a second or so at 300,000
    rows), and the key is the one :func:`tokenized_cache_key` gives the split."""
    import finetune.data
    from finetune.assembly import setup_run
    from finetune.config import load_config
    from finetune.truncation import truncation_of

    digested = []
    digest_rows = finetune.data.digest_rows
    monkeypatch.setattr(finetune.data, "digest_rows", lambda digest, ds: (digested.append(len(ds)),
                                                                          digest_rows(digest, ds))[1])
    cfg = load_config(REPO / "configs" / "default.yaml", [
        f"model.name_or_path={tiny['model']}", tsv_train_file(tiny["data"]), "data.max_length=16",
        "training.per_device_train_batch_size=4", "training.effective_batch_size=8",
        f"output.output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'cache'}"])
    run = setup_run(cfg)
    assert digested == [54, 6]  # the training split once, the held-out one for its own key
    train = load_splits(cfg.data, seed=cfg.split_seed)[0]["train"]
    key = tokenized_cache_key(train, run.tokenizer, 16, truncation_of(cfg.data))
    assert (tmp_path / "cache" / f"{key}.arrow").is_file()
    assert key != tokenized_cache_key(train.select(range(53)), run.tokenizer, 16)  # the rows are in the key
    assert run.data_sha256 == finetune.data.content_sha256(train)


def fresh_accelerate_state_reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_a_tokenizer_folder_of_its_own_loads(tiny, tokenizer, tmp_path):
    """``model.tokenizer_name_or_path`` names a folder ``tokenizer.save_pretrained`` wrote, which has no model's
    config.json: it loads, and tokenizes as the model's own tokenizer."""
    from finetune.config import ModelConfig
    from finetune.modeling import load_tokenizer

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert not (tmp_path / "tokenizer" / "config.json").exists()
    loaded = load_tokenizer(ModelConfig(name_or_path=str(tiny["model"]),
                                        tokenizer_name_or_path=str(tmp_path / "tokenizer")))
    texts = ["free cash now", "see you at lunch"]
    assert loaded(texts)["input_ids"] == tokenizer(texts)["input_ids"]
