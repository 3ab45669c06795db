"""Tiny offline models and data for the tests: nothing here touches the network (a URL is served by
:func:`serving`, on this machine)."""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parent.parent

WORDS = [
    "free", "win", "prize", "cash", "call", "now", "claim", "urgent", "offer", "txt",
    "hello", "see", "you", "later", "lunch", "home", "ok", "thanks", "love", "tonight",
    "meeting", "work", "dinner", "sorry", "late", "tomorrow", "good", "morning", "night", "yes",
]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


class RecordingTokenizer:
    """A tokenizer that records every text it is asked to tokenize (its ``texts``), and is the tokenizer otherwise."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []

    def __call__(self, texts, *args, **kwargs):
        self.texts.extend(texts)
        return self.tokenizer(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def tiny_bert_config(num_labels: int = 2, dropout: float = 0.0, vocab_size: int = len(SPECIAL) + len(WORDS)):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )


def tiny_bert(num_labels: int = 2, seed: int = 0, dropout: float = 0.0):
    """A 2-layer random BERT classifier (float32, dropout off by default)."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(tiny_bert_config(num_labels, dropout))


# transformers' encoders whose output for a text reads the padding around it (finetune.truncation.READS_THE_PADDING):
# data.padding: auto pads every batch of theirs to one length, and the tests pad theirs so
PADDING_READERS = ("convbert", "big_bird", "nystromformer", "yoso", "fnet")
# The encoder families the package supports, as transformers' model types; tiny_model builds each. Five came with
# transformers 5 (eurobert to ultrabert): on an older release their tests are skipped. The padding readers but
# BigBird, whose block-sparse attention fails under bf16 and fp16 autocast in transformers 5.25 (docs/accumulation.md)
ARCHITECTURES = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta-v2", "modernbert", "albert",
                 "mpnet", "camembert", "mobilebert", "roformer", "ernie", "data2vec-text", "longformer",
                 "rembert", "roberta-prelayernorm", "xlm-roberta-xl",
                 "eurobert", "gte", "jina_embeddings_v3", "nomic_bert", "ultrabert",
                 *(family for family in PADDING_READERS if family != "big_bird"))
# what each family's tiny config needs beyond tiny_model's common sizes (bench/families.py builds from them too)
ARCHITECTURE_SIZES = {
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 37},
    "electra": {"embedding_size": 16},
    "albert": {"embedding_size": 16},
    # DeBERTa-v3's: a LayerNorm of the relative embeddings beside the blocks
    "deberta-v2": {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 8,
                   "norm_rel_ebd": "layer_norm"},
    # token ids inside the tiny vocabulary (ModernBERT's defaults point past it)
    "modernbert": {"global_attn_every_n_layers": 2, "local_attention": 16, "pad_token_id": 0, "bos_token_id": 2,
                   "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3},
    "eurobert": {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3, "mask_token_id": 4},
    # a window the tiny texts exceed, in the first layer; the second attends to all
    "ultrabert": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3},
    # a window of 4 tokens, which the tiny texts exceed in both layers
    "longformer": {"attention_window": 4, "pad_token_id": 0},
    # its input and output embeddings narrower than the blocks, as RemBERT's are
    "rembert": {"input_embedding_size": 16, "output_embedding_size": 16},
    # random blocks drawn where texts are longer than (5 + 2 random) blocks of 2 tokens
    "big_bird": {"attention_type": "block_sparse", "block_size": 2, "num_random_blocks": 1, "pad_token_id": 0},
    "convbert": {"pad_token_id": 0},
    "nystromformer": {"pad_token_id": 0},
    "yoso": {"pad_token_id": 0},
    "fnet": {"pad_token_id": 0},
}
# the collate of a family's micro-batches in the comparisons: each padded to its longest text, and the encoders that
# read the padding to one length (ONE_LENGTH tokens: token_dataset's texts are at most 25), as data.padding: auto does
ONE_LENGTH = 32


def blind_to_the_head(model, name: str) -> bool:
    """Whether the parameter ``name`` of ``model`` cannot reach a classification head that reads the first token,
    whatever the data: its gradient is zero, so it does not move (a bias), and a LoRA adapter on it never trains.
    Longformer's last block: the first token attends globally, through the block's global projections, so its
    local ``query``, ``key`` and ``value`` shape only the other tokens' outputs, which no head reads."""
    if model.config.model_type != "longformer":
        return False
    last = model.config.num_hidden_layers - 1
    return re.search(rf"\.layer\.{last}\.attention\.self\.(query|key|value)\.", name) is not None


def tiny_model(model_type: str, num_labels: int = 3, seed: int = 0, dropout: Optional[float] = None):
    """A 2-layer random ``...ForSequenceClassification`` of transformers' ``model_type`` (float32).

    ``dropout`` sets every dropout probability of the config (each family names its own), for the
    comparisons that need the same computation in every run; ``None`` keeps the family's defaults.
    """
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForSequenceClassification

    if model_type not in CONFIG_MAPPING:
        import pytest

        pytest.skip(f"transformers {transformers.__version__} has no {model_type} models")
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37,
             "vocab_size": len(SPECIAL) + len(WORDS), "max_position_embeddings": 64, "num_labels": num_labels}
    config = AutoConfig.for_model(model_type, **sizes, **ARCHITECTURE_SIZES.get(model_type, {}))
    if dropout is not None:
        from finetune.modeling import set_dropout

        set_dropout(config, dropout)
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


# the final norm a pre-LayerNorm family's encoder keeps beside its blocks, which runs on the last block's output
FINAL_NORMS = {"xlm-roberta-xl": "roberta.encoder.LayerNorm."}


def expected_depths(model) -> dict[str, int]:
    """Each parameter's depth by name, the tests' oracle for ``finetune.depths.layer_depths``, read from the names
    and the module types alone: block i of the stack is depth i + 1; the encoder's embeddings (named so, or an
    embedding table) and what the blocks' module holds beside them (DeBERTa's relative positions and their norm,
    MPNet's relative attention bias) 0, but a final norm there (:data:`FINAL_NORMS`); the rest, above the blocks,
    L + 1."""
    from finetune.lora import layer_stack

    stack, blocks = layer_stack(model)
    prefix = model.base_model_prefix
    holder = ".".join(stack.split(".")[:2])
    final = FINAL_NORMS.get(model.config.model_type)
    tables = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    depths = {}
    for name, _ in model.named_parameters():
        found = re.search(rf"{re.escape(stack)}\.(\d+)\.", name)
        if found:
            depths[name] = int(found.group(1)) + 1
        elif final is not None and name.startswith(final):
            depths[name] = len(blocks) + 1
        elif name.startswith(f"{holder}.") or name.startswith(f"{prefix}.") and ("embed" in name.lower()
                                                                                or name in tables):
            depths[name] = 0
        else:
            depths[name] = len(blocks) + 1
    return depths


class Flat(torch.nn.Module):
    """A model whose encoder has no transformer blocks the package can find (a remote-code model, say)."""

    base_model_prefix = "encoder"

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(4, 4)


def save_tiny_model(directory: Path, num_labels: int = 2, seed: int = 0, model_type: str = "bert") -> Path:
    """Save a tiny random BERT (or encoder of transformers' ``model_type``, as :func:`tiny_model` builds it) with a
    matching WordPiece tokenizer to ``directory``."""
    from transformers import AutoModel, BertModel, BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS) + "\n", encoding="utf-8")
    # transformers 5 takes the vocabulary as `vocab` and silently ignores `vocab_file`,
    # which left every word [UNK]: the tiny model could not tell texts apart
    tokenizer = BertTokenizerFast(vocab=str(vocab), vocab_file=str(vocab), do_lower_case=True, model_max_length=64)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    # A bare encoder, like the embedded MiniLM: the classification head is created by fine-tuning.
    if model_type == "bert":
        model = BertModel(tiny_bert_config(num_labels))
        model.config.architectures = ["BertModel"]
    else:
        model = AutoModel.from_config(tiny_model(model_type, num_labels=num_labels, seed=seed, dropout=0.0).config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def save_tiny_deberta_v3(directory: Path, max_positions: int = 64) -> Path:
    """A tiny random DeBERTa-v3 encoder with a SentencePiece tokenizer trained here, saved as the Hub's are.

    Like ``microsoft/deberta-v3-base``: relative positions only (``position_biased_input: false``), and a
    tokenizer that is an ``spm.model`` with no ``tokenizer.json``, which transformers reads with the
    ``sentencepiece`` library. Its ``model_max_length`` is ``max_positions``, as 512 is there.
    """
    import sentencepiece
    from transformers import AutoConfig, AutoModel

    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    rng = random.Random(0)
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "spm"), vocab_size=48, model_type="unigram",
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]", eos_piece="[SEP]",
        unk_piece="[UNK]", user_defined_symbols=["[MASK]"], minloglevel=2)
    (directory / "spm.vocab").unlink()
    corpus.unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"do_lower_case": False, "vocab_type": "spm", "model_max_length": max_positions}), encoding="utf-8")
    config = AutoConfig.for_model("deberta-v2", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=37, vocab_size=64, max_position_embeddings=max_positions,
                                  relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                                  position_biased_input=False, pad_token_id=0)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(directory)
    return directory


def make_texts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (label, text) pairs; spam uses spam-ish words, so the task is learnable."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "spam" if rng.random() < 0.3 else "ham"
        pool = WORDS[:10] if label == "spam" else WORDS[10:]
        length = rng.randint(2, 20)
        rows.append((label, " ".join(rng.choice(pool) if rng.random() < 0.8 else rng.choice(WORDS)
                                     for _ in range(length))))
    return rows


def write_tsv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        for label, text in rows:
            fh.write(f"{label}\t{text}\n")
    return path


def tsv_train_file(path: Path) -> str:
    """The override ``data.train_file=<mapping>`` for a file of :func:`write_tsv`: headerless ``label<TAB>text``.

    The layout goes with the file, as in ``configs/default.yaml``'s mapping for the SMS file.
    """
    return f"data.train_file={{path: '{path}', format: tsv, has_header: false, column_names: [label, text]}}"


def write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        for label, text in rows:
            writer.writerow([text, label])
    return path


def compiling_with(monkeypatch, backend) -> None:
    """``torch.compile`` (and so ``Module.compile``, which calls it) with one of dynamo's debugging backends instead
    of inductor, which compiles for minutes on a CPU: ``eager`` runs torch's own kernels on the captured graph,
    ``aot_eager`` AOTAutograd's forward and backward graphs too. A callable backend (``(graph, example_inputs) ->
    callable``) serves as well, to count what is compiled."""
    compile_for_real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: compile_for_real(fn, **{**kw, "backend": backend}))


def token_dataset(n: int, seed: int = 0, vocab: int = 35, max_len: int = 24, num_labels: int = 2):
    """``n`` pre-tokenized samples of varying length (for loop-level tests)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        length = int(torch.randint(3, max_len, (1,), generator=g))
        ids = torch.randint(5, vocab, (length,), generator=g).tolist()
        items.append({"input_ids": [2] + ids + [3], "labels": int(torch.randint(0, num_labels, (1,), generator=g))})
    return items


def collate_for(model_type: str):
    """:func:`pad_collate` as a family's micro-batches are padded: to one length for an encoder that reads the
    padding (``data.padding: auto``), to each micro-batch's longest text for the rest."""
    return functools.partial(pad_collate, width=ONE_LENGTH) if model_type in PADDING_READERS else pad_collate


def pad_collate(items: list[dict[str, Any]], width: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Each micro-batch padded to its longest text, or (``width``) to that many tokens, and masked."""
    width = width or max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, : len(x["input_ids"])] = torch.tensor(x["input_ids"])
        mask[i, : len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([x["labels"] for x in items])}


def chunked_texts(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` texts of 1 to 5 windows each, as data.truncation: chunks tokenizes them (windows of varying length)."""
    g = torch.Generator().manual_seed(seed)
    texts = []
    for i in range(n):
        windows = [[2, *torch.randint(5, 35, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist(), 3]
                   for _ in range(1 + i % 5)]
        texts.append({"input_ids": windows, "labels": int(torch.randint(0, 2, (1,), generator=g))})
    return texts


def chunk_collate(texts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """:func:`pad_collate` for :func:`chunked_texts`: a row per window (finetune.chunks.ChunkCollator)."""
    from finetune.chunks import ChunkCollator

    def rows(windows):
        return {k: v for k, v in pad_collate([{**w, "labels": 0} for w in windows]).items() if k != "labels"}

    return ChunkCollator(rows)(texts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wandb_offline_starts(wandb_dir: Path, run_id: str) -> list[SimpleNamespace]:
    """Each start of the offline W&B run ``run_id`` under ``wandb_dir`` (its ``WANDB_DIR``), in order: the name and
    the group it gave the run, and the ``(update, train/loss)`` it holds. Read from the start's ``.wandb`` file, a
    LevelDB-style log of W&B's protobuf records (wandb has no public reader of it)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    starts = []
    for path in sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        data, pos, chunks = path.read_bytes(), 7, []  # a 7-byte header: ":W&B", a key, a version
        start = SimpleNamespace(name=None, group=None, steps=[])
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk's header is padding
                pos += 32768 - pos % 32768
                continue
            length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])  # after a 4-byte checksum
            if kind == 0:
                break
            chunks.append(data[pos + 7:pos + 7 + length])
            pos += 7 + length
            if kind in (1, 4):  # a record whole, or its last chunk
                record = wandb_internal_pb2.Record.FromString(b"".join(chunks))
                chunks = []
                if record.WhichOneof("record_type") == "run":
                    start.name, start.group = record.run.display_name, record.run.run_group
                elif record.WhichOneof("record_type") == "history":
                    item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    if "train/loss" in item:
                        start.steps.append((item["_step"], item["train/loss"]))
        starts.append(start)
    return starts


def offline_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra or {})
    return env


# what takes seconds to import: a check that answers at once must not need any of them
HEAVY_MODULES = ("torch", "transformers", "datasets")


def call_in_a_fresh_python(function: str, *args: Any, env: Optional[dict[str, str]] = None
                           ) -> tuple[str, list[str], str]:
    """``function(*args)`` (``"finetune.train.main"``) in a new Python process, offline.

    Returns:
        The repr of what it returned, which of :data:`HEAVY_MODULES` it imported, and its stderr.
    """
    results, imported, stderr = calls_in_a_fresh_python(function, [args], env=env)
    return results[0], imported, stderr


def calls_in_a_fresh_python(function: str, arg_lists: Sequence[Sequence[Any]], env: Optional[dict[str, str]] = None,
                            modules: Sequence[str] = HEAVY_MODULES, timeout: float = 60
                            ) -> tuple[list[str], list[str], str]:
    """``function(*args)`` for each ``args`` of ``arg_lists``, in order, in one new Python process, offline.

    Returns:
        The repr of what each call returned, which of ``modules`` the process had imported after the last, and
        its stderr.
    """
    module, name = function.rsplit(".", 1)
    calls = [list(args) for args in arg_lists]
    code = (f"import sys; from {module} import {name}\n"
            f"for args in {calls!r}: print('RESULT', repr({name}(*args)))\n"
            f"print('IMPORTED', ','.join(m for m in {tuple(modules)!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=offline_env(env), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    results = [line.removeprefix("RESULT ") for line in lines if line.startswith("RESULT ")]
    imported = [line.removeprefix("IMPORTED ") for line in lines if line.startswith("IMPORTED ")][-1]
    return results, [m for m in imported.split(",") if m], done.stderr


def run_cli(args: list[str], timeout: float = 300, env: Optional[dict[str, str]] = None,
            launcher: Optional[list[str]] = None) -> subprocess.CompletedProcess:
    """Run ``accelerate launch finetune/train.py ARGS`` (or another launcher) as a command of its own, offline
    (a fork of the worker's fork server where :func:`forked.forkable` allows, else a subprocess)."""
    import forked

    # -q: on a failing child, accelerate's single-process launcher would add a traceback of its own
    launcher = launcher or [sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "1",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return forked.run(launcher + [str(REPO / "finetune" / "train.py")] + args, env=offline_env(env), timeout=timeout)


def write_sms_job(root: Path, **sections: dict) -> Path:
    """``root/cfg.yaml``: a small run of the tiny BERT (dropout 0.1) on 60 generated SMS-like rows, 48 of them
    for training, in fp32; ``sections`` update the config's sections (``training={"max_steps": 12}``)."""
    import yaml

    cfg: dict[str, dict] = {
        "model": {"name_or_path": str(save_tiny_model(root / "tiny-bert")), "dropout": 0.1},
        "data": {"train_file": str(write_tsv(root / "sms.tsv", make_texts(60, seed=3))), "format": "tsv",
                 "has_header": False, "column_names": ["label", "text"], "validation_split": 0.2, "max_length": 32},
        "training": {"seed": 1, "mixed_precision": "no"},
        "optim": {"learning_rate": 1e-3},
        "evaluation": {"metrics": ["accuracy"], "average": "macro"},
        "logging": {"progress_bar": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


@contextlib.contextmanager
def serving(folder: Path, private: tuple[str, ...] = ()) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on this machine's loopback serving ``folder``, as a web server or a bucket's HTTP
    endpoint serves files: each answer carries an ETag of the file's bytes, by which datasets' download cache
    knows a changed file; the ``private`` names are answered 403, as a file that needs credentials is. Yields
    the base URL and the list of requests it answered (``"GET /name 200"``)."""
    import functools
    import hashlib
    import http.server
    import threading

    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def send_head(self):
            if self.path.split("?")[0].lstrip("/") in private:
                self.send_error(403, "Forbidden")
                return None
            return super().send_head()

        def end_headers(self):
            served = folder / self.path.split("?")[0].lstrip("/")
            if served.is_file():
                self.send_header("ETag", f'"{hashlib.sha256(served.read_bytes()).hexdigest()}"')
            super().end_headers()

        def log_request(self, code="-", size="-"):
            requests.append(f"{self.command} {self.path} {int(code)}")

        def log_message(self, *args):  # the test's output stays its own
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def a_fresh_log():
    """The root logger without pytest's handlers, as a command's process starts: what the command sets up on it is
    what shows on stderr. Both handlers and level are put back after."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
