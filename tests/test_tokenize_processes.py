"""Several processes tokenizing a split (``data.tokenize_processes``): the same tokens, a cache any number of
processes reads back, the tokenizer's own threads given back, and ``auto``'s choice."""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import pytest

from finetune.config import load_config
from finetune.errors import ConfigError
from finetune.tables import LABELS, TEXT, TEXT_PAIR
from finetune.tokens import ROWS_PER_PROCESS, ROWS_TO_START_AFRESH, tokenize_splits, tokenizing_processes
from finetune.truncation import Truncation
from helpers import REPO, make_texts, save_tiny_model, tsv_train_file, write_tsv


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("tokprocs") / "tiny-bert"))


def splits(pairs: bool = False) -> datasets.DatasetDict:
    """Texts of 1 to 40 words, so that a window of 16 tokens cuts some of them into several."""
    texts = [" ".join(text for _, text in make_texts(1 + i % 8, seed=i)) for i in range(70)]
    columns = {TEXT: texts, LABELS: [i % 2 for i in range(70)]}
    if pairs:
        columns[TEXT_PAIR] = list(reversed(texts))
    whole = datasets.Dataset.from_dict(columns)
    return datasets.DatasetDict({"train": whole.select(range(60)), "validation": whole.select(range(60, 70))})


def rows(ds: datasets.Dataset) -> dict[str, list]:
    return {column: ds[column] for column in ds.column_names}


@pytest.mark.parametrize("side, pairs", [("head", False), ("chunks", False), ("head", True)])
def test_several_processes_tokenize_to_one_process_tokens(tokenizer, side, pairs):
    data = splits(pairs)
    truncation = Truncation(side, 16)
    one = tokenize_splits(data, tokenizer, 16, truncation=truncation)
    three = tokenize_splits(data, tokenizer, 16, truncation=truncation, processes=3)
    assert max(one["train"]["full_length"]) > 16  # some texts were cut, or windowed
    for name in data:
        assert three[name].features == one[name].features
        assert rows(three[name]) == rows(one[name])


def test_an_error_met_in_a_tokenizing_process_is_the_one_a_single_process_raises(tokenizer):
    """A window that leaves no new token is refused as the texts are cut: in a worker process, the same one line."""
    errors = []
    for processes in (1, 2):
        with pytest.raises(ConfigError) as raised:
            tokenize_splits(splits(), tokenizer, 16, truncation=Truncation("chunks", 16, stride_tokens=14),
                            processes=processes)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and errors[0].startswith("data.stride: 14 leaves a window no new token")


SPAWNED = """
import sys; sys.path.insert(0, 'tests')
import multiprocess
from transformers import AutoTokenizer
from finetune.tokens import tokenize_splits
from test_tokenize_processes import rows, splits
multiprocess.set_start_method('spawn', force=True)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
one = tokenize_splits(splits(), tokenizer, 16)
two = tokenize_splits(splits(), tokenizer, 16, processes=2)
print(multiprocess.get_start_method(), all(rows(one[name]) == rows(two[name]) for name in one))
"""


@pytest.mark.slow
def test_processes_started_afresh_tokenize_to_the_same_tokens(tokenizer, tmp_path):
    """Where worker processes are spawned, not forked (macOS, Windows), the tokenizing function and its tokenizer
    reach them pickled, and each imports the package anew: the same tokens."""
    import subprocess
    import sys

    from helpers import offline_env

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    done = subprocess.run([sys.executable, "-c", SPAWNED, str(tmp_path / "tokenizer")], cwd=REPO,
                          env=offline_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["spawn", "True"]


def test_cached_shards_are_read_back_whatever_the_number_of_processes(tokenizer, tmp_path):
    data = splits()
    two = tokenize_splits(data, tokenizer, 16, cache_dir=tmp_path, processes=2)
    files = sorted(path.name for path in tmp_path.glob("*.arrow"))
    assert len(files) == 4 and all(name.endswith(("_00000_of_00002.arrow", "_00001_of_00002.arrow"))
                                   for name in files)
    for processes in (1, 3):
        again = tokenize_splits(data, tokenizer, 16, cache_dir=tmp_path, processes=processes)
        # read from the two shards of each split, none tokenized again (which would write new files)
        assert sorted(path.name for path in tmp_path.glob("*.arrow")) == files
        for name in data:
            assert [f["filename"] for f in again[name].cache_files] == [f["filename"] for f in two[name].cache_files]
            assert rows(again[name]) == rows(two[name])
    assert rows(two["train"]) == rows(tokenize_splits(data, tokenizer, 16)["train"])


def test_without_the_cache_a_read_file_is_tokenized_in_memory(tokenizer, tmp_path):
    """A split read from a file is backed by datasets' own Arrow file, beside which map() would write its result
    under a name of its own (a file the run was told not to keep) and, finding it there, hand a later call's
    every shard to one process. Without the cache nothing is written, and several processes share the work."""
    from finetune.config import DataConfig
    from finetune.data import load_splits

    data = write_tsv(tmp_path / "train.tsv", make_texts(60, seed=5))
    read = load_splits(DataConfig(train_file=str(data), format="tsv", has_header=False,
                                  column_names=["label", "text"], validation_split=0.2), seed=0)[0]
    folder = Path(read["train"].cache_files[0]["filename"]).parent
    before = sorted(folder.iterdir())
    for processes in (1, 2):
        tokenized = tokenize_splits(read, tokenizer, 16, processes=processes)
        assert all(split.cache_files == [] for split in tokenized.values())
    assert sorted(folder.iterdir()) == before


def environment_variable(name: str):
    """``name`` as the process's C environment holds it, which the tokenizers library reads (``os.environ`` is
    Python's mapping of it, which can be rebound to a copy)."""
    import ctypes

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    value = getenv(name.encode())
    return None if value is None else value.decode()


@pytest.mark.parametrize("before", [None, "true"])
def test_the_tokenizer_keeps_its_threads_after_several_processes(tokenizer, monkeypatch, tmp_path, before):
    """datasets sets TOKENIZERS_PARALLELISM=false for the processes it forks and leaves it set underneath, or,
    where all the shards are cached, in os.environ too; it is put back, both times."""
    if before is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)
    for _ in ("tokenized in processes", "read from their shards"):
        tokenize_splits(splits(), tokenizer, 16, cache_dir=tmp_path, processes=2)
        assert os.environ.get("TOKENIZERS_PARALLELISM") == before
        assert environment_variable("TOKENIZERS_PARALLELISM") == before


@pytest.mark.parametrize("cores, local, rows, expected", [
    (2, None, 2 * ROWS_PER_PROCESS - 1, 1),  # not a row for each of two processes
    (2, None, 2 * ROWS_PER_PROCESS, 2),      # two processes on two cores: every core
    (2, None, 300_000, 2),                   # no more than the cores
    (16, None, 2 * ROWS_PER_PROCESS, 1),     # two workers lose to one process's threads on 16 cores
    (16, None, 3 * ROWS_PER_PROCESS, 3),
    (16, None, 300_000, 12),                 # one per ROWS_PER_PROCESS rows
    (16, None, 1_000_000, 16),
    (1, None, 1_000_000, 1),
    (16, "4", 300_000, 4),                   # four processes launched on the machine: a quarter of its cores each
    (16, "4", 2 * ROWS_PER_PROCESS, 1),
    (16, "32", 1_000_000, 1),                # fewer cores than processes
])
def test_auto_is_a_process_per_rows_within_the_cores_share(monkeypatch, cores, local, rows, expected):
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        if local is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, local)
    assert tokenizing_processes("auto", rows, cores=cores, start_method="fork") == expected
    assert tokenizing_processes(5, rows, cores=cores) == 5  # a number is that number


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_auto_starts_fresh_interpreters_for_large_splits_only(monkeypatch, start_method):
    """Processes that import the libraries anew pay seconds before their first text: none below
    ROWS_TO_START_AFRESH rows, the same rule as forked ones from there."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    below, at = ROWS_TO_START_AFRESH - 1, ROWS_TO_START_AFRESH
    assert tokenizing_processes("auto", below, cores=16, start_method="fork") == min(16, below // ROWS_PER_PROCESS)
    assert tokenizing_processes("auto", below, cores=16, start_method=start_method) == 1
    assert tokenizing_processes("auto", at, cores=16, start_method=start_method) == min(16, at // ROWS_PER_PROCESS)
    assert tokenizing_processes(4, 1000, cores=16, start_method=start_method) == 4


START_METHOD = """
import multiprocess
from finetune.tokens import workers_start_method
read = workers_start_method()
multiprocess.set_start_method("spawn")  # raises where the read settled the method for the program
print(read, multiprocess.get_all_start_methods()[0], workers_start_method())
"""


def test_the_start_method_is_the_one_datasets_would_use_and_reading_it_leaves_it_unsettled():
    """The platform's default (fork on Linux before Python 3.14) until the program sets one, then that one; the
    read does not settle it, so that the program may still set its own."""
    import subprocess
    import sys

    from helpers import offline_env

    done = subprocess.run([sys.executable, "-c", START_METHOD], cwd=REPO, env=offline_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    read, default, after = done.stdout.split()
    assert read == default and after == "spawn"


@pytest.mark.parametrize("value, message", [
    ("0", "command line: data.tokenize_processes: must be >= 1 or auto, got 0"),
    ("-2", "command line: data.tokenize_processes: must be >= 1 or auto, got -2"),
    ("many", "command line: data.tokenize_processes: expected int or 'auto', got str 'many'"),
])
def test_a_wrong_number_of_processes_is_one_config_error(value, message):
    with pytest.raises(ConfigError) as raised:
        load_config(REPO / "configs" / "default.yaml", [f"data.tokenize_processes={value}"])
    assert str(raised.value) == message
    assert load_config(REPO / "configs" / "default.yaml", []).data.tokenize_processes == "auto"


def test_a_run_tokenizes_in_the_processes_its_config_says(tmp_path, fresh_accelerate_state):
    """``setup_run`` hands ``data.tokenize_processes`` to the tokenizing: its cache holds two shards per split,
    and its batches are a one-process run's."""
    from finetune.assembly import setup_run
    from accelerate.state import AcceleratorState, GradientState

    model = save_tiny_model(tmp_path / "tiny-bert")
    data = write_tsv(tmp_path / "train.tsv", make_texts(60, seed=3))

    def first_batch(processes: str, cache: str):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        cfg = load_config(REPO / "configs" / "default.yaml", [
            f"model.name_or_path={model}", tsv_train_file(data), "data.max_length=16",
            "training.per_device_train_batch_size=4", "training.effective_batch_size=8",
            f"output.output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / cache}",
            f"data.tokenize_processes={processes}"])
        return next(iter(setup_run(cfg).train_dataloader))

    two = first_batch("2", "two")
    assert len(list((tmp_path / "two").glob("*_of_00002.arrow"))) == 4
    one = first_batch("1", "one")
    assert len(list((tmp_path / "one").glob("*.arrow"))) == 2 and not list((tmp_path / "one").glob("*_of_*"))
    assert one.keys() == two.keys() and all((one[key] == two[key]).all() for key in one)
