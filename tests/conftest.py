import atexit
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Never touch the network from the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test workers (pytest -n auto: one per core) share the machine's cores, so every run here, in a
# worker or as a command it starts, computes on one thread: a second thread per run would only wait,
# spinning, for a core another worker holds. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("FINETUNE_CPU_THREADS", "1")
# The Arrow files `datasets` writes and the package's tokenized-split cache go to a folder of
# this session (inherited by the CLI runs), not the user's ~/.cache. Set before datasets is imported.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="finetune-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)
sys.path.insert(0, str(Path(__file__).resolve().parent))


# The files that take longest (measured with pytest --durations=0), in that order. xdist hands whole files to its
# workers (--dist loadfile) in the order they are collected when told --no-loadscope-reorder (its own order puts
# the files with the most tests first, and so a file of a few long tests last): these go first, so that no worker
# is left running one of them alone while the other has finished.
LONGEST_FIRST = ("test_sweep.py", "test_bench.py", "test_compile_option.py", "test_packaging.py", "test_scaling.py",
                 "test_own_data.py", "test_notebooks.py", "test_hub.py", "test_accumulation.py", "test_cuda_graphs.py",
                 "test_never_lose_a_run.py", "test_predict.py", "test_dry_run.py", "test_auto_batch.py",
                 "test_noise_scale.py", "test_checkpoint.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def pytest_collection_finish(session):
    """What the test modules imported (torch, transformers, ...) lives as long as the worker: the full
    collections a run makes (one before it allocates, one after each sweep trial) skip its objects, about half a
    second of a core each time they would walk them."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def fresh_accelerate_state():
    """Each test gets its own Accelerator settings (k, precision); reset Accelerate's singletons."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def downloads(tmp_path, monkeypatch):
    """datasets allowed to download, into a cache of the test's own: for URLs that ``helpers.serving`` serves
    on this machine (the suite is otherwise offline)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", str(tmp_path / "downloads"))


@pytest.fixture
def strict_fp32(fresh_accelerate_state):
    """TF32 off on a GPU, so that its fp32 differs from itself only in the order of its sums."""
    import torch

    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(scope="session")
def tokenizers(tmp_path_factory):
    """The tiny model's WordPiece vocabulary as a fast (Rust) and a slow (Python) tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    from helpers import save_tiny_model

    folder = save_tiny_model(tmp_path_factory.mktemp("tok") / "tiny-bert")
    fast = AutoTokenizer.from_pretrained(folder)
    # transformers 5 renamed the pure-Python tokenizer; 4.x calls it BertTokenizer
    slow_class = getattr(transformers, "BertTokenizerLegacy", None) or transformers.BertTokenizer
    slow = slow_class(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    assert hasattr(fast, "backend_tokenizer") and not hasattr(slow, "backend_tokenizer")
    return {"fast": fast, "slow": slow}
