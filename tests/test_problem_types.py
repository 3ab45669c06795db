"""Multi-label, regression, class weights and a caller's loss: the accumulation contract for each.

For every loss the package computes, and for one a caller passes, ``(b, k)``
must train the weights of ``(b*k, 1)`` after every update, the ragged last
window included. The end-to-end runs then check that the saved model carries
its ``problem_type``, so ``transformers.pipeline`` gives what ``finetune
predict`` gives.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from finetune.config import ModelConfig, OptimConfig, config_from_dict
from finetune.errors import ConfigError, DataError
from finetune.loop import TrainState, train_one_epoch
from finetune.optimization import build_optimizer, build_scheduler, plan_updates
from finetune.sampling import EpochSampler
from finetune.tasks import Task, balanced_weights
from helpers import ARCHITECTURES, WORDS, make_texts, pad_collate, tiny_bert, tiny_model, token_dataset
from tiny_run import fit_tiny_run, reset_accelerate

# 76 samples, b=8: windows of 4, 4 and 2 micro-batches at k=4, the last micro-batch short
N = 76


def _data(problem_type: str, num_labels: int = 3):
    data = token_dataset(N, seed=1, num_labels=num_labels)
    g = torch.Generator().manual_seed(2)
    for item in data:
        if problem_type == "multi_label":
            item["labels"] = (torch.rand(num_labels, generator=g) < 0.4).float().tolist()
        elif problem_type == "regression":
            item["labels"] = float(torch.randn((), generator=g)) * 2 + 1
    return data


def _run(b: int, k: int, problem_type: str = "single_label", num_labels: int = 3, loss_fn=None):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model = tiny_bert(num_labels=1 if problem_type == "regression" else num_labels, seed=0)
    model.config.problem_type = {"single_label": "single_label_classification",
                                 "multi_label": "multi_label_classification", "regression": "regression"}[problem_type]
    opt_cfg = OptimConfig(learning_rate=1e-3, warmup_steps=1)
    optimizer = build_optimizer(model, opt_cfg)
    data = _data(problem_type, num_labels)
    dl = DataLoader(data, batch_size=b, sampler=EpochSampler(N, seed=7, window_size=b * k), collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    scheduler = build_scheduler(optimizer, opt_cfg, plan_updates(len(dl), k, 2, None, warmup_steps=1))
    snapshots, records, state = [], [], TrainState()
    for epoch in range(2):
        train_one_epoch(model, optimizer, scheduler, dl, acc, epoch, state=state, loss_fn=loss_fn,
                        on_log=records.append,
                        on_update=lambda s: snapshots.append(
                            {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}))
    return snapshots, records, data


def _assert_same(a, b):
    assert len(a) == len(b) == 6  # 3 updates per epoch, 2 epochs
    for update, (sa, sb) in enumerate(zip(a, b)):
        for name in sa:
            # atol: the attention's key bias gets a zero gradient up to rounding, noise of 1e-7 either way
            torch.testing.assert_close(sa[name], sb[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"update {update}, {name}: {m}")


def _differs(a, b) -> bool:
    return any(not torch.allclose(a[-1][n], b[-1][n], rtol=1e-4, atol=1e-6) for n in a[-1])


@pytest.mark.parametrize("problem_type", ["multi_label", "regression"])
def test_accumulated_windows_equal_the_big_batch(fresh_accelerate_state, problem_type):
    big, big_records, data = _run(32, 1, problem_type)
    small, records, _ = _run(8, 4, problem_type)
    _assert_same(big, small)
    # the logged loss is the big batch's: the per-sample loss's mean over the window
    assert [r["train/loss"] for r in records] == pytest.approx([r["train/loss"] for r in big_records], rel=1e-5)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_a_new_regression_head_starts_at_the_targets_mean_in_every_family(model_type):
    import datasets

    from finetune.tasks import start_regression_head

    model = tiny_model(model_type, num_labels=1).eval()
    head = tuple(n for n, _ in model.named_parameters() if not n.startswith(f"{model.base_model_prefix}."))
    ids = torch.randint(5, 20, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    targets = datasets.Dataset.from_dict({"labels": [1.0, 2.5, 4.0, 3.5]})
    regression = ModelConfig(problem_type="regression")
    assert start_regression_head(regression, model, head, targets) == 2.75
    with torch.no_grad():
        after = model(input_ids=ids).logits
    # the output's own bias moved: every prediction shifted by the mean, nothing else changed
    torch.testing.assert_close(after - before, torch.full_like(before, 2.75))
    # a head the model had, `zero`, and the other problem types are left as they are
    for cfg, new_head in ((regression, ()), (ModelConfig(problem_type="regression", regression_head_bias="zero"), head),
                          (ModelConfig(problem_type="multi_label"), head)):
        assert start_regression_head(cfg, model, new_head, targets) is None
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, after)


def test_the_multi_label_and_regression_losses_are_transformers_own():
    """The per-sample losses average to what the model computes itself from its problem_type."""
    torch.manual_seed(0)
    for problem_type, num_labels, labels in (
        ("multi_label", 3, (torch.rand(5, 3) < 0.5).float()),
        ("regression", 1, torch.randn(5)),
    ):
        model = tiny_bert(num_labels=num_labels).eval()
        model.config.problem_type = {"multi_label": "multi_label_classification", "regression": "regression"}[
            problem_type]
        ids = torch.randint(5, 30, (5, 7))
        out = model(input_ids=ids, labels=labels)
        ours = Task(problem_type).per_sample_loss(out.logits, labels)
        assert ours.shape == (5,)
        assert ours.mean().item() == pytest.approx(out.loss.item(), rel=1e-6)


def test_class_weights_keep_the_contract_and_use_the_sample_mean(fresh_accelerate_state):
    weights = torch.tensor([1.0, 3.0, 0.5])
    weighted = Task("single_label", weights).per_sample_loss
    big, big_records, data = _run(32, 1, loss_fn=weighted)
    small, records, _ = _run(8, 4, loss_fn=weighted)
    _assert_same(big, small)
    plain, _, _ = _run(8, 4)
    assert _differs(small, plain)  # the weights are really applied
    # the first update's loss is (1/N) sum_i w[y_i] CE_i over its window, under the initial weights
    order = EpochSampler(N, seed=7, window_size=32).order()[:32]
    model = tiny_bert(num_labels=3, seed=0).eval()
    batch = pad_collate([data[i] for i in order])
    labels = batch.pop("labels")
    with torch.no_grad():
        ce = F.cross_entropy(model(**batch).logits, labels, reduction="none")
    assert records[0]["train/loss"] == pytest.approx((weights[labels] * ce).sum().item() / 32, rel=1e-5)
    # not PyTorch's weighted mean, which divides by the sum of the weights
    torch_mean = F.cross_entropy(model(**batch).logits, labels, weight=weights).item()
    assert records[0]["train/loss"] != pytest.approx(torch_mean, rel=1e-3)


def test_a_callers_loss_keeps_the_contract(fresh_accelerate_state):
    def smoothed(logits, labels):
        return F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=0.2)

    big, _, _ = _run(32, 1, loss_fn=smoothed)
    small, _, _ = _run(8, 4, loss_fn=smoothed)
    _assert_same(big, small)
    plain, _, _ = _run(8, 4)
    assert _differs(small, plain)


def test_label_smoothing_is_the_trainers_and_keeps_the_contract_with_class_weights(fresh_accelerate_state):
    from transformers.trainer_pt_utils import LabelSmoother

    # the mean of the per-sample losses is the Trainer's label_smoothing_factor loss on the same logits
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 3), torch.tensor([0, 2, 1, 1, 0, 2])
    ours = Task("single_label", label_smoothing=0.1).per_sample_loss(logits, labels)
    assert ours.shape == (6,)
    assert ours.mean().item() == pytest.approx(LabelSmoother(0.1)({"logits": logits}, labels).item(), rel=1e-6)
    # with class weights: (8, 4) is (32, 1) after every update, and the smoothing is really applied
    weights = torch.tensor([1.0, 3.0, 0.5])
    smoothed = Task("single_label", weights, label_smoothing=0.2).per_sample_loss
    big, big_records, _ = _run(32, 1, loss_fn=smoothed)
    small, records, _ = _run(8, 4, loss_fn=smoothed)
    _assert_same(big, small)
    assert [r["train/loss"] for r in records] == pytest.approx([r["train/loss"] for r in big_records], rel=1e-5)
    weighted_only, _, _ = _run(8, 4, loss_fn=Task("single_label", weights).per_sample_loss)
    assert _differs(small, weighted_only)


def test_a_run_smooths_its_labels_and_says_so(tmp_path):
    from finetune.start_line import describe

    seen = []
    fit_tiny_run(tmp_path, before_fit=lambda run: seen.append((run.task, describe(run))),
                 training={"label_smoothing": 0.1, "num_train_epochs": None, "max_steps": 2})
    (task, start), = seen
    assert task == Task("single_label", label_smoothing=0.1) and " label_smoothing=0.1 " in start


def test_a_loss_that_reduces_is_refused(fresh_accelerate_state):
    with pytest.raises(ValueError, match=r"loss_fn must return one loss per row \(shape \(8,\)\), got shape \(\)"):
        _run(8, 4, loss_fn=lambda logits, labels: F.cross_entropy(logits, labels))


def test_balanced_weights_average_to_one_over_the_samples():
    counts = [90, 9, 1]
    weights = balanced_weights(counts)
    assert weights == pytest.approx([100 / 270, 100 / 27, 100 / 3])
    assert sum(w * c for w, c in zip(weights, counts)) / sum(counts) == pytest.approx(1.0)


# --------------------------------------------------------------------------- reading the labels

def _cfg(tmp_path, problem_type, **data):
    return config_from_dict({"data": {"validation_split": 0.0, **data}, "model": {"problem_type": problem_type}})


@pytest.mark.parametrize("problem_type", ["single_label", "multi_label", "regression"])
def test_the_labels_column_is_the_one_python_lists_make(tmp_path, problem_type):
    """The label ids, vectors and targets are handed to datasets as arrays (an Arrow list column for vectors),
    which it fingerprints in milliseconds where a list took seconds: the column is the one a list of Python values
    makes, its type and values, and so the split's digest, which the token cache and a resume compare."""
    import datasets

    from finetune.data import content_sha256, load_splits

    labels_of = {"single_label": lambda i: ["b", "a", "c"][i % 3], "multi_label": lambda i: "|".join("xyz"[:i % 4]),
                 "regression": lambda i: f"{i / 7:.6f}"}[problem_type]
    path = tmp_path / "rows.csv"
    path.write_text("text,label\n" + "".join(f"t{i},{labels_of(i)}\n" for i in range(50)), encoding="utf-8")
    delimiter = "|" if problem_type == "multi_label" else None
    cfg = _cfg(tmp_path, problem_type, train_file=str(path), label_delimiter=delimiter)
    train = load_splits(cfg.data, seed=0, problem_type=problem_type)[0]["train"]
    values = train.with_format("arrow")["labels"].to_pylist()  # as Python lists, then added as lists were
    as_lists = train.remove_columns("labels").add_column("labels", values, feature=train.features["labels"])
    assert train.features == as_lists.features
    assert train.data.column("labels").type == as_lists.data.column("labels").type
    assert content_sha256(train) == content_sha256(as_lists)
    first = {"single_label": [1, 0, 2, 1], "regression": [float(np.float32(f"{i / 7:.6f}")) for i in range(4)],
             "multi_label": [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]}[problem_type]
    assert values[:4] == first
    assert isinstance(train.features["labels"], {"single_label": datasets.ClassLabel, "multi_label": datasets.Sequence,
                                                 "regression": datasets.Value}[problem_type])


def test_multi_label_reads_lists_and_delimited_strings(tmp_path, caplog):
    from finetune.data import load_splits

    jsonl = tmp_path / "tags.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"text": "a", "label": ["sport", "news"]}, {"text": "b", "label": []}, {"text": "c", "label": ["art"]},
    ]) + "\n", encoding="utf-8")
    cfg = _cfg(tmp_path, "multi_label", train_file=str(jsonl))
    splits, labels = load_splits(cfg.data, seed=0, problem_type="multi_label")
    assert labels.names == ["art", "news", "sport"] and labels.problem_type == "multi_label"
    assert splits["train"]["labels"] == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]

    # a CSV field cannot hold an empty list: with a delimiter, an empty field is a text with no label, and
    # the run says how many there are
    csv_file = tmp_path / "tags.csv"
    # (spaces around a label are how it was typed, and a part of spaces alone is no label)
    csv_file.write_text('text,label\na,"sport| news"\nb,\nc,art\nd,""\ne,"art |  "\n', encoding="utf-8")
    cfg = _cfg(tmp_path, "multi_label", train_file=str(csv_file), label_delimiter="|")
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(cfg.data, seed=0, problem_type="multi_label")
    assert labels.names == ["art", "news", "sport"]
    assert splits["train"]["labels"] == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0],
                                         [1.0, 0.0, 0.0]]
    assert "tags.csv: 2 of 5 texts have no label (lines 3, 5)" in caplog.text
    # integer labels, one per field, read as numbers: each is a set of one, numbered as numbers ("2" before "10")
    csv_file.write_text('text,label\na,10\nb,\nc,2\n', encoding="utf-8")
    splits, labels = load_splits(cfg.data, seed=0, problem_type="multi_label")
    assert labels.names == ["2", "10"] and splits["train"]["labels"] == [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    # without a delimiter an empty field is a missing label, as for single labels
    csv_file.write_text('text,label\na,\nb,\n', encoding="utf-8")
    cfg = _cfg(tmp_path, "multi_label", train_file=str(csv_file))
    with pytest.raises(DataError, match=r"tags.csv: 2 rows without labels in column 'label' \(lines 2, 3\); a text "
                                        r"with none has an empty field when data.label_delimiter is set"):
        load_splits(cfg.data, seed=0, problem_type="multi_label")
    csv_file.write_text('text,label\na,"sport| news"\nb,art\n', encoding="utf-8")
    # strings without a delimiter: one line saying what to set
    cfg = _cfg(tmp_path, "multi_label", train_file=str(csv_file))
    with pytest.raises(DataError, match=r"line 2 .* is a string; for multi_label set data.label_delimiter"):
        load_splits(cfg.data, seed=0, problem_type="multi_label")


def test_multi_label_reads_a_column_per_label_as_the_set_of_its_ones(tmp_path, caplog):
    """A column per label (Jigsaw's toxic comments' layout), each 0/1, true/false or "1"/"0", gives the label
    vectors the same rows give as lists, its labels in the columns' order rather than sorted; an empty cell is a
    row without labels (refused, or dropped by data.on_missing_label), and a cell that is neither is named."""
    from finetune.data import load_splits

    names = ["toxic", "insult", "threat"]  # not sorted: the ids follow the columns
    rng = random.Random(0)
    rows = [{"text": f"t{i}", **{name: rng.random() < 0.4 for name in names}} for i in range(30)]
    rows[0].update(toxic=True, insult=True, threat=True)  # every label present in the train data
    per_label = tmp_path / "per_label.csv"
    per_label.write_text("id,text,toxic,insult,threat\n" + "".join(
        f"{i},{r['text']},{int(r['toxic'])},{int(r['insult'])},{str(r['threat']).lower()}\n" for i, r in enumerate(rows)),
        encoding="utf-8")
    as_lists = tmp_path / "lists.jsonl"
    as_lists.write_text("".join(json.dumps({"text": r["text"], "label": [n for n in names if r[n]]}) + "\n"
                                for r in rows), encoding="utf-8")
    cfg = _cfg(tmp_path, "multi_label", train_file=str(per_label), label_column=names)
    splits, labels = load_splits(cfg.data, seed=0, problem_type="multi_label")
    assert labels.names == names
    # one of the columns named alone is told the list of them all (not the ids, which are no 0/1 column)
    with pytest.raises(DataError, match=r"per_label.csv: label 1 at line 2 in column 'toxic' is not a list") as info:
        load_splits(_cfg(tmp_path, "multi_label", train_file=str(per_label), label_column="toxic").data, seed=0,
                    problem_type="multi_label")
    assert info.value.hint == ('a 0/1 column per label: --label "[toxic, insult, threat]" (data.label_column=[toxic, '
                               'insult, threat])')
    # a column without a 1 teaches nothing: the model has no output for it, and the run says so
    zeros = tmp_path / "zeros.csv"
    zeros.write_text("text,a,b,c\nx,1,0,0\ny,0,1,0\nz,1,1,0\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        taught = load_splits(_cfg(tmp_path, "multi_label", train_file=str(zeros), label_column=["a", "b", "c"]).data,
                             seed=0, problem_type="multi_label")[1]
    assert taught.names == ["a", "b"]
    assert ("zeros.csv: column 'c' holds no 1 in the training rows: the model has no output for it "
            "(data.label_column)") in caplog.text
    # such a column is among the labels data.drop_labels may name (one no column is, is not), without the warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        dropped = _cfg(tmp_path, "multi_label", train_file=str(zeros), label_column=["a", "b", "c"], drop_labels=["c"])
        assert load_splits(dropped.data, seed=0, problem_type="multi_label")[1].names == ["a", "b"]
    assert "holds no 1" not in caplog.text
    dropped.data.drop_labels = ["d"]
    with pytest.raises(ConfigError, match=r"data.drop_labels: 'd' not among the labels of .*zeros.csv \(a, b, c\)$"):
        load_splits(dropped.data, seed=0, problem_type="multi_label")
    # the columns typed as one, comma-separated: the list that names them
    with pytest.raises(DataError, match=r"per_label.csv: no column 'toxic,insult' \(data.label_column\)") as info:
        load_splits(_cfg(tmp_path, "multi_label", train_file=str(per_label), label_column="toxic,insult").data, seed=0,
                    problem_type="multi_label")
    assert info.value.hint == ('a 0/1 column per label: --label "[toxic, insult]" (data.label_column=[toxic, insult]) '
                               'with model.problem_type=multi_label')
    listed, sorted_labels = load_splits(_cfg(tmp_path, "multi_label", train_file=str(as_lists)).data, seed=0,
                                        problem_type="multi_label")
    order = [sorted_labels.names.index(name) for name in names]
    assert splits["train"]["labels"] == [[vector[j] for j in order] for vector in listed["train"]["labels"]]
    assert splits["train"]["labels"][:1] == [[1.0, 1.0, 1.0]]
    # the words of a JSON file's strings
    words = tmp_path / "words.jsonl"
    words.write_text('{"text": "a", "toxic": "1", "insult": " FALSE"}\n{"text": "b", "toxic": "0", "insult": "true"}\n',
                     encoding="utf-8")
    cfg = _cfg(tmp_path, "multi_label", train_file=str(words), label_column=["toxic", "insult"])
    assert load_splits(cfg.data, seed=0, problem_type="multi_label")[0]["train"]["labels"] == [[1.0, 0.0], [0.0, 1.0]]
    # an empty cell: the row has no labels, refused with its line, or left out
    gap = tmp_path / "gap.csv"
    gap.write_text("text,toxic,insult\na,1,0\nb,,1\nc,0,1\n", encoding="utf-8")
    cfg = _cfg(tmp_path, "multi_label", train_file=str(gap), label_column=["toxic", "insult"])
    with pytest.raises(DataError, match=r"gap.csv: 1 row without labels in column \['toxic', 'insult'\] \(line 3\); "
                                        r"a text with none has 0 in each"):
        load_splits(cfg.data, seed=0, problem_type="multi_label")
    cfg.data.on_missing_label = "drop"
    with caplog.at_level(logging.INFO, logger="finetune"):
        kept = load_splits(cfg.data, seed=0, problem_type="multi_label")[0]["train"]
    assert kept["text"] == ["a", "c"] and "gap.csv: left out 1 of 3 lines without a label (line 3" in caplog.text
    # a cell that is no 0 or 1, and a column the file lacks
    gap.write_text("text,toxic,insult\na,1,0\nb,0,1\nc,2,1\n", encoding="utf-8")
    cfg.data.on_missing_label = "error"
    with pytest.raises(DataError, match=r"gap.csv: 2 at line 4 in column 'toxic' is not 0 or 1 \(data.label_column "
                                        r"names a column per label"):
        load_splits(cfg.data, seed=0, problem_type="multi_label")
    cfg.data.label_column = ["toxic", "threat"]
    with pytest.raises(DataError, match=r"gap.csv: no column 'threat' \(data.label_column\); columns found: text, "
                                        r"toxic, insult$"):
        load_splits(cfg.data, seed=0, problem_type="multi_label")


def test_a_run_on_a_column_per_label_is_scored_and_predicted_by_those_columns(tmp_path, capsys):
    """A tiny run on files with a column per label: its model's labels are the columns in order, its test scores
    are what finetune score gives the file, and finetune predict on the file says it can be scored."""
    from transformers import AutoConfig

    from finetune.predict import main as predict
    from finetune.score import score_file

    names = ["money", "hurry"]
    for name, n, seed in (("train", 80, 1), ("val", 30, 2), ("test", 20, 3)):
        rows = _tagged_rows(n, seed)
        (tmp_path / f"{name}.csv").write_text("text,hurry,money\n" + "".join(
            f"{r['text']},{int('hurry' in r['tags'])},{int('money' in r['tags'])}\n" for r in rows), encoding="utf-8")
    cfg, summary = fit_tiny_run(
        tmp_path, model={"problem_type": "multi_label"},
        data={"train_file": str(tmp_path / "train.csv"), "validation_file": str(tmp_path / "val.csv"),
              "test_file": str(tmp_path / "test.csv"), "format": "auto", "has_header": None, "column_names": None,
              "label_column": names},
        evaluation={"metrics": ["accuracy", "f1"], "average": "auto", "positive_label": None})
    out = Path(cfg.output.output_dir)
    assert AutoConfig.from_pretrained(out).id2label == {0: "money", 1: "hurry"}  # the columns' order, not the file's
    scored = score_file(out, tmp_path / "test.csv", count_seen=False)
    assert summary["test"]["metrics"] == scored.metrics and scored.metrics["num_samples"] == 20
    assert set(summary["test"]["by_label"]) == set(names)
    capsys.readouterr()
    assert predict([str(out), "--file", str(tmp_path / "test.csv"), "--output", str(tmp_path / "p.csv")]) == 0
    assert (f"note: {tmp_path / 'test.csv'} has the run's label columns: finetune score {out} --file "
            f"{tmp_path / 'test.csv'} scores the model on it") in capsys.readouterr().err


def test_a_validation_label_the_training_data_lacks_names_its_row(tmp_path):
    from finetune.data import load_splits

    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text('{"text": "a", "label": ["x", "y"]}\n{"text": "b", "label": ["y"]}\n', encoding="utf-8")
    val.write_text('{"text": "c", "label": ["y"]}\n{"text": "d", "label": ["z"]}\n', encoding="utf-8")
    cfg = _cfg(tmp_path, "multi_label", train_file=str(train), validation_file=str(val))
    with pytest.raises(DataError, match=r"val.jsonl: label 'z' at line 2 not among the 2 labels"):
        load_splits(cfg.data, seed=0, problem_type="multi_label")


def test_regression_reads_numbers_and_names_a_row_that_is_not_one(tmp_path):
    from finetune.data import load_splits

    good = tmp_path / "scores.csv"
    good.write_text("text,similarity\na,0.5\nb,4\nc,-1.25\n", encoding="utf-8")
    cfg = _cfg(tmp_path, "regression", train_file=str(good), label_column="similarity")
    splits, labels = load_splits(cfg.data, seed=0, problem_type="regression")
    assert labels.names == ["similarity"] and splits["train"]["labels"] == [0.5, 4.0, -1.25]
    bad = tmp_path / "bad.csv"
    bad.write_text("text,similarity\na,0.5\nb,high\n", encoding="utf-8")
    cfg = _cfg(tmp_path, "regression", train_file=str(bad), label_column="similarity")
    with pytest.raises(DataError, match=r"bad.csv: label 'high' at line 3 in column 'similarity' is not a number"):
        load_splits(cfg.data, seed=0, problem_type="regression")


@pytest.mark.parametrize("sections, message", [
    ({"model": {"problem_type": "multilabel"}}, r"model.problem_type: expected one of .* \(did you mean 'multi_label'\?\)"),
    ({"training": {"class_weights": "balance"}}, r"training.class_weights: expected 'balanced' or mapping"),
    ({"training": {"class_weights": {"spam": 0}}}, r"training.class_weights: weight of 'spam' must be > 0"),
    ({"training": {"class_weights": "balanced"}, "model": {"problem_type": "regression"}},
     r"training.class_weights: apply to single_label only"),
    ({"data": {"label_delimiter": ","}}, r"data.label_delimiter: splits multi_label labels only"),
    ({"training": {"label_smoothing": 1.0}}, r"training.label_smoothing: must be in \[0, 1\), got 1.0"),
    ({"training": {"label_smoothing": 0.1}, "model": {"problem_type": "regression"}},
     r"training.label_smoothing: applies to single_label only \(model.problem_type is regression\)"),
    ({"model": {"problem_type": "multi_label"}, "evaluation": {"average": "binary", "positive_label": "x"}},
     r"evaluation.average: binary needs single_label"),
    ({"model": {"problem_type": "multi_label"}, "evaluation": {"threshold": 1.0}},
     r"evaluation.threshold: must be between 0 and 1, or per_label, got 1.0"),
    ({"model": {"problem_type": "multi_label"}, "evaluation": {"threshold": "best"}},
     r"evaluation.threshold: expected float or 'per_label' or mapping of str to float, got str 'best'"),
    ({"evaluation": {"threshold": "per_label"}, "model": {"problem_type": "regression"}},
     r"evaluation.threshold: decides between classes, and regression has none \(model.problem_type is regression\)"),
    # a column per label: multi_label's layout alone, two columns at least, each once, no delimiter to split them
    ({"data": {"label_column": ["toxic", "insult"]}},
     r"data.label_column: a list names a column per label, which is multi_label's layout \(model.problem_type is "
     r"single_label\)"),
    ({"data": {"label_column": ["toxic"]}, "model": {"problem_type": "multi_label"}},
     r"data.label_column: a list names a column per label, and multi_label needs at least two \(got \['toxic'\]\)"),
    ({"data": {"label_column": ["toxic", "insult", "toxic"]}, "model": {"problem_type": "multi_label"}},
     r"data.label_column: 'toxic' named more than once"),
    ({"data": {"label_column": ["toxic", "insult"], "label_delimiter": "|"}, "model": {"problem_type": "multi_label"}},
     r"data.label_delimiter: splits the labels of one column, and data.label_column names a column per label"),
    ({"data": {"label_column": ["toxic", 3]}, "model": {"problem_type": "multi_label"}},
     r"data.label_column\[1\]: expected str, got int 3"),
])
def test_a_bad_problem_type_setting_is_one_line_naming_the_key(sections, message):
    tree = {"data": {"train_file": "x.csv"}}
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tree)


def test_a_single_label_metric_list_keeps_what_the_problem_type_computes(caplog):
    def metrics(problem_type, names=None):
        evaluation = {"metrics": names} if names else {}
        return config_from_dict({"data": {"train_file": "x.csv"}, "model": {"problem_type": problem_type},
                                 "evaluation": evaluation}).evaluation.metrics

    assert metrics("regression") == ["pearson", "spearmanr", "mse"]  # the default list has no regression metric
    assert metrics("multi_label") == ["accuracy", "f1"]
    caplog.clear()
    # the shipped configs' list, with problem_type given on the command line
    shipped = ["accuracy", "f1", "precision", "recall", "matthews_correlation"]
    assert metrics("multi_label", shipped) == ["accuracy", "f1", "precision", "recall"]
    assert "evaluation.metrics: matthews_correlation not computed for multi_label" in caplog.text
    assert metrics("regression", shipped + ["mae"]) == ["mae"]
    assert metrics("single_label", shipped) == shipped


def test_a_shipped_configs_metrics_give_way_to_the_problem_type_without_a_warning(tmp_path, caplog):
    # the README's regression line (the default config, problem_type on the command line) must not warn of a
    # metric list its user never wrote; the same list in a config of one's own, or on the command line, is warned of
    import shutil

    from finetune.config import DEFAULT_CONFIG, load_config

    own = tmp_path / "mine.yaml"
    shutil.copy(DEFAULT_CONFIG, own)
    regression = ["model.problem_type=regression"]
    listed = ["evaluation.metrics=[accuracy, mae]"]
    said = {}
    for name, path, overrides in [("shipped", None, regression), ("own", own, regression),
                                  ("listed", None, regression + listed)]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="finetune"):
            metrics = load_config(path, overrides).evaluation.metrics
        said[name] = (metrics, [r.getMessage() for r in caplog.records if "evaluation.metrics" in r.getMessage()])
    assert said["shipped"] == (["pearson", "spearmanr", "mse"], [])
    assert said["own"][0] == ["pearson", "spearmanr", "mse"]
    assert said["own"][1] == ["evaluation.metrics: accuracy, f1, precision, recall, matthews_correlation not computed "
                              "for regression (it computes pearson, spearmanr, mse, mae); using pearson, spearmanr, mse"]
    assert said["listed"] == (["mae"], ["evaluation.metrics: accuracy not computed for regression (it computes "
                                        "pearson, spearmanr, mse, mae); using mae"])


# --------------------------------------------------------------------------- metrics

def test_multi_label_metrics_follow_their_definitions():
    from finetune.metrics.other_tasks import MultiLabelMetrics

    ref = [[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]]
    pred = [[1, 0, 0], [0, 1, 0], [1, 0, 1], [0, 0, 0]]
    # per label (tp, fp, fn): label 0 (2, 0, 0), label 1 (1, 0, 1), label 2 (0, 1, 1)
    micro = MultiLabelMetrics(["accuracy", "f1", "precision", "recall"], 3, "micro").compute(pred, ref)
    assert micro == pytest.approx({"accuracy": 0.5, "f1": 6 / 9, "precision": 3 / 4, "recall": 3 / 5})
    macro = MultiLabelMetrics(["f1"], 3, "macro").compute(pred, ref)
    assert macro["f1"] == pytest.approx((1.0 + 2 / 3 + 0.0) / 3)
    weighted = MultiLabelMetrics(["f1"], 3, "weighted").compute(pred, ref)
    assert weighted["f1"] == pytest.approx((2 * 1.0 + 2 * 2 / 3 + 1 * 0.0) / 5)


def test_regression_metrics_follow_their_definitions():
    from finetune.metrics.other_tasks import RegressionMetrics

    pred = [1.0, 2.0, 2.0, 5.0, 4.0]
    ref = [1.5, 1.0, 3.0, 4.0, 4.0]
    m = RegressionMetrics(["pearson", "spearmanr", "mse", "mae"]).compute(pred, ref)
    assert m["mse"] == pytest.approx((0.25 + 1 + 1 + 1 + 0) / 5) and m["mae"] == pytest.approx(3.5 / 5)
    p, r = torch.tensor(pred, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    assert m["pearson"] == pytest.approx(torch.corrcoef(torch.stack([p, r]))[0, 1].item())
    # average ranks with ties: pred -> 1, 2.5, 2.5, 5, 4; ref -> 2, 1, 3, 4.5, 4.5
    rp, rr = torch.tensor([1, 2.5, 2.5, 5, 4]), torch.tensor([2, 1, 3, 4.5, 4.5])
    assert m["spearmanr"] == pytest.approx(torch.corrcoef(torch.stack([rp, rr]))[0, 1].item())


# --------------------------------------------------------------------------- end to end, and pipeline()

TEXTS = ["free cash prize call now", "see you at dinner tonight", "win", "urgent claim your offer txt now free",
         "sorry late for the meeting tomorrow morning", "hello ok thanks love you"]


def _tagged_rows(n: int, seed: int):
    """Texts tagged ``money`` (cash, prize, free) and ``hurry`` (now, urgent), either, both or none."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        tags = [t for t, cue in (("money", {"cash", "prize", "free"}), ("hurry", {"now", "urgent"}))
                if cue & set(words)]
        rows.append({"text": " ".join(words), "tags": tags, "score": sum(w in WORDS[:10] for w in words) / len(words)})
    return rows


@pytest.fixture(scope="module")
def problem_runs(tmp_path_factory):
    from finetune.start_line import describe

    root = tmp_path_factory.mktemp("problems")
    runs = {}
    for problem_type, label_column in (("multi_label", "tags"), ("regression", "score")):
        folder = root / problem_type
        folder.mkdir()
        # 100 validation texts: on 30 the thresholds chosen seldom beat 0.5 on 95% of resamples, and 0.5 stays
        for name, n, seed in (("train", 120, 1), ("val", 100, 2), ("test", 40, 3)):
            with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as fh:
                for row in _tagged_rows(n, seed):
                    fh.write(json.dumps(row) + "\n")
        said = []
        cfg, summary = fit_tiny_run(
            folder,
            before_fit=lambda run: said.append(describe(run)),
            model={"problem_type": problem_type},
            data={"train_file": str(folder / "train.jsonl"), "validation_file": str(folder / "val.jsonl"),
                  "test_file": str(folder / "test.jsonl"), "format": "auto", "has_header": None,
                  "column_names": None, "label_column": label_column},
            # the multi-label run chooses each label's threshold at each evaluation (finetune.thresholds)
            evaluation={"metrics": ["accuracy", "f1"] if problem_type == "multi_label" else ["pearson", "mse"],
                        "average": "auto", "positive_label": None,
                        "threshold": "per_label" if problem_type == "multi_label" else 0.5},
            training={"num_train_epochs": 8},
        )
        runs[problem_type] = (folder / "out", summary, said[0])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("problem_type", ["multi_label", "regression"])
def test_a_test_set_is_scored_with_the_problem_types_metrics_as_finetune_score_scores_it(problem_runs, problem_type):
    """A multi-label run's test texts at the thresholds its validation texts chose, a regression run's with its
    correlations: what finetune score gives the saved model on the file."""
    from finetune.score import score_file

    out, summary, start = problem_runs[problem_type]
    assert "; test: 40 rows of test.jsonl, scored after training" in start
    scored = score_file(out, out.parent / "test.jsonl", count_seen=False)
    assert summary["test"]["metrics"] == scored.metrics and summary["test"]["intervals"] == scored.intervals
    assert summary["test"]["metrics"]["num_samples"] == 40
    if problem_type == "regression":
        assert set(scored.metrics) == {"loss", "num_samples", "pearson", "mse"} and summary["test"]["by_label"] is None
    else:
        assert {name: s["threshold"] for name, s in summary["test"]["by_label"].items()} == summary["eval_thresholds"]


@pytest.mark.slow
def test_a_multi_label_run_learns_and_pipeline_agrees_with_predict(problem_runs, capsys):
    from transformers import AutoConfig, pipeline

    from finetune.predict import Predictor

    from finetune.score import score_file
    from finetune.score_tables import format_by_label

    out, summary, start = problem_runs["multi_label"]
    assert "for 2 labels, any number per text (hurry, money) on train.jsonl" in start
    assert "average=micro thresholds=per_label (for micro F1)" in start
    assert AutoConfig.from_pretrained(out).problem_type == "multi_label_classification"
    assert summary["labels"] == ["hurry", "money"]
    assert set(summary["eval"]) == {"loss", "num_samples", "accuracy", "f1"}
    # each label scored alone: its support is the texts of the validation file that carry it, and the run's
    # micro F1 (auto averaging for multi-label) is the F1 of the labels' summed counts
    by_label = summary["eval_by_label"]
    val = [json.loads(line)["tags"] for line in (out.parent / "val.jsonl").read_text().splitlines()]
    assert list(by_label) == ["hurry", "money"]
    assert [by_label[name]["support"] for name in by_label] == [sum(name in tags for tags in val)
                                                                 for name in by_label]
    tp = sum(s["recall"] * s["support"] for s in by_label.values())
    predicted = sum(s["recall"] * s["support"] / s["precision"] for s in by_label.values() if s["precision"])
    assert summary["eval"]["f1"] == pytest.approx(2 * tp / (sum(s["support"] for s in by_label.values()) + predicted))
    assert problem_runs["regression"][1]["eval_by_label"] is None
    # each metric has its interval over the validation texts, a regression run's too (where defined); that they
    # are the texts' spread, tests/test_metrics.py holds against resampling the texts one by one
    assert set(summary["eval_intervals"]) == {"accuracy", "f1"}
    assert all(0 <= low <= high <= 1 for low, high in summary["eval_intervals"].values())
    regression = problem_runs["regression"][1]
    defined = {name for name, value in regression["eval"].items()
               if name not in ("loss", "num_samples") and value == value}  # NaN: a correlation over a constant
    assert set(regression["eval_intervals"]) == defined and "mse" in defined
    assert 0 <= regression["eval_intervals"]["mse"][0] <= regression["eval_intervals"]["mse"][1]
    reset_accelerate()
    predictor = Predictor.load(out, device="cpu")
    # finetune score on the validation file scores each label, and its intervals, as the run's last evaluation did
    scored = score_file(out, out.parent / "val.jsonl", predictor=predictor)
    assert scored.intervals == summary["eval_intervals"]
    # each label's row of the file's scores says the threshold it was scored at: the run's
    assert {name: scores.pop("threshold") for name, scores in scored.by_label.items()} == summary["eval_thresholds"]
    assert scored.by_label == by_label
    ours = predictor.predict(TEXTS)
    theirs = pipeline("text-classification", model=str(out), device="cpu", top_k=None)(TEXTS)
    # the run chose each label's threshold (evaluation.threshold: per_label); the saved config carries them
    thresholds = summary["eval_thresholds"]
    assert list(thresholds) == ["hurry", "money"] and all(0 < t < 1 for t in thresholds.values())
    assert set(thresholds.values()) != {0.5}  # they beat 0.5 on the resamples, and moved
    assert AutoConfig.from_pretrained(out).label_thresholds == thresholds
    assert predictor.task.threshold == tuple(thresholds.values())
    card = (out / "README.md").read_text()
    named = ", ".join(f"{name} {t:.3g}" for name, t in thresholds.items())
    assert f"- Thresholds: {named}, each label's chosen on the validation texts for the best micro F1" in card
    # on the validation texts they were chosen on, each label's F1 is at least 0.5's, which the same file scored
    # with evaluation.threshold=0.5 gives; and the run's micro F1 too, the F1 they were chosen for
    at_half = score_file(out, out.parent / "val.jsonl", ["evaluation.threshold=0.5"], predictor=predictor)
    assert {scores["threshold"] for scores in at_half.by_label.values()} == {0.5}
    table = format_by_label(at_half.by_label).splitlines()
    assert table[1].endswith("predicted  threshold") and all(row.endswith("      0.5") for row in table[2:])
    assert all(by_label[name]["f1"] >= at_half.by_label[name]["f1"] for name in by_label)
    assert summary["eval"]["f1"] >= at_half.metrics["f1"]
    assert at_half.by_label != by_label  # at 0.5 this model predicts other labels: the thresholds moved them
    # every evaluation chose its own; a checkpoint saved after one carries that evaluation's
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    chosen = {r["step"]: r["eval_thresholds"] for r in records if "eval_thresholds" in r}
    assert len(chosen) == 8 and chosen[max(chosen)] == thresholds
    for checkpoint in (out / "checkpoints").iterdir():
        step = int(checkpoint.name.split("-")[1])
        assert AutoConfig.from_pretrained(checkpoint).label_thresholds == chosen[step]
    for mine, scores in zip(ours, theirs):
        # the pipeline applies a sigmoid per label, because the saved config says multi_label
        assert mine["probabilities"] == pytest.approx({d["label"]: d["score"] for d in scores}, abs=1e-5)
        assert mine["labels"] == [d for d in predictor.labels if mine["probabilities"][d] > thresholds[d]]
    # it learned the cue of "hurry": every text with "now" or "urgent" scores above every other
    hurry = [p["probabilities"]["hurry"] for p in ours]
    assert min(h for h, t in zip(hurry, TEXTS) if "now" in t or "urgent" in t) > max(
        h for h, t in zip(hurry, TEXTS) if not ("now" in t or "urgent" in t))
    # a higher threshold predicts fewer labels, down to none for a text
    strict = Predictor(predictor.model, predictor.tokenizer, threshold=0.9).predict(TEXTS)
    assert [p["labels"] for p in strict] == [[d for d in predictor.labels if p["probabilities"][d] > 0.9]
                                            for p in strict]
    assert any(not p["labels"] for p in strict)
    # finetune predict predicts at the model's thresholds, and at --threshold's where it is given
    from finetune.predict import main as predict

    capsys.readouterr()
    assert predict([str(out), *TEXTS]) == 0 and predict([str(out), *TEXTS, "--threshold", "0.9"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["labels"] for line in lines] == [p["labels"] for p in ours + strict]
    assert [p["labels"] for p in ours] != [[d for d in predictor.labels if p["probabilities"][d] > 0.5] for p in ours]
    # by label name: the label named at its own, the other at the model's
    assert predict([str(out), *TEXTS, "--threshold", "{hurry: 0.9}"]) == 0
    named = {"hurry": 0.9, "money": thresholds["money"]}
    assert [json.loads(line)["labels"] for line in capsys.readouterr().out.splitlines()] == \
        [[d for d in predictor.labels if p["probabilities"][d] > named[d]] for p in ours]
    # finetune score reads each label's operating points at the thresholds it scored at, and takes them by name
    assert {name: rows[0]["threshold"] for name, rows in scored.operating_points.items()} == pytest.approx(thresholds)
    at_named = score_file(out, out.parent / "val.jsonl", ["evaluation.threshold={hurry: 0.9}"], predictor=predictor)
    assert {name: scores["threshold"] for name, scores in at_named.by_label.items()} == pytest.approx(named)
    assert at_named.by_label["money"] == {**by_label["money"], "threshold": thresholds["money"]}
    assert at_named.operating_points["hurry"][0]["threshold"] == 0.9
    # to a file: a CSV joins each text's labels with the run's data.label_delimiter, a Parquet file keeps the list
    import csv

    import pyarrow.parquet as pq

    texts = out.parent / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    capsys.readouterr()
    for name in ("predicted.csv", "predicted.parquet"):
        assert predict([str(out), "--file", str(texts), "--output", str(out.parent / name)]) == 0
    # each summed up in a line: the texts given each label beside the share of the validation texts that carry it
    # (several labels per text: shares of the texts, which need not add up to 1), and those given none
    given = {name: sum(name in p["labels"] for p in ours) for name in predictor.labels}
    shares = [f"{name} {given[name]} ({given[name] / len(TEXTS):.1%}; validation "
              f"{by_label[name]['support'] / summary['eval']['num_samples']:.1%})"
              for name in sorted(given, key=lambda name: -given[name])]
    none = sum(not p["labels"] for p in ours)
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{len(TEXTS)} texts predicted: {', '.join(shares)}; no label {none} ({none / len(TEXTS):.1%}) "
        f"-> {out.parent / 'predicted.parquet'}")
    with open(out.parent / "predicted.csv", newline="", encoding="utf-8") as fh:
        assert [row["labels"] for row in csv.DictReader(fh)] == [",".join(p["labels"]) for p in ours]
    assert pq.read_table(out.parent / "predicted.parquet").column("labels").to_pylist() == [p["labels"] for p in ours]


def test_thresholds_chosen_on_validation_texts_need_validation_texts(tmp_path):
    from finetune import setup_run
    from tiny_run import tiny_config, tiny_process

    rows = _tagged_rows(40, 1)
    with open(tmp_path / "train.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    cfg = tiny_config(tmp_path, model={"problem_type": "multi_label"}, evaluation={
        "threshold": "per_label", "metrics": ["f1"], "average": "auto", "positive_label": None},
        data={"train_file": str(tmp_path / "train.jsonl"), "validation_file": None, "validation_split": 0.0,
              "format": "auto", "has_header": None, "column_names": None, "label_column": "tags"})
    with tiny_process(), pytest.raises(ConfigError, match=r"^evaluation.threshold: per_label chooses thresholds "
                                                          r"on the validation texts, and this run has none"):
        setup_run(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_regression_run_learns_and_pipeline_agrees_with_predict(problem_runs, tmp_path, capsys):
    from transformers import AutoConfig, pipeline

    from finetune.predict import Predictor
    from finetune.score import score_file

    out, summary, start = problem_runs["regression"]
    assert "for regression on score on train.jsonl" in start
    # the new head starts at the training scores' mean (model.regression_head_bias: mean, the default)
    scores = [json.loads(line)["score"] for line in (out.parent / "train.jsonl").read_text().splitlines()]
    assert f"(new head starting at the targets' mean, {sum(scores) / len(scores):.4g})" in start
    assert AutoConfig.from_pretrained(out).problem_type == "regression"
    assert set(summary["eval"]) == {"loss", "num_samples", "pearson", "mse"}
    assert summary["eval"]["loss"] == pytest.approx(summary["eval"]["mse"], rel=1e-5)  # the loss is the MSE
    reset_accelerate()
    predictor = Predictor.load(out, device="cpu")
    ours = predictor.predict(TEXTS)
    # no function_to_apply: the saved problem_type tells pipeline to leave the number as it is
    theirs = pipeline("text-classification", model=str(out), device="cpu")(TEXTS)
    assert [p["score"] for p in ours] == pytest.approx([t["score"] for t in theirs], abs=1e-5)
    # finetune predict sums a file's scores up in a line: their range and mean
    from finetune.predict import main as predict

    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert predict([str(out), "--file", str(tmp_path / "texts.txt")]) == 0
    scores = [p["score"] for p in ours]
    summed = capsys.readouterr().err.splitlines()[-1]
    low, high, mean = (float(n) for n in re.fullmatch(
        rf"{len(TEXTS)} texts predicted: scores from (\S+) to (\S+), mean (\S+)", summed).groups())
    assert (low, high, mean) == pytest.approx((min(scores), max(scores), sum(scores) / len(scores)), rel=1e-3)
    assert max(scores) - min(scores) > 1e-3 * max(map(abs, scores))  # far enough apart that a swap would show
    # score reads the validation file as training did and reports what validation reported
    result = score_file(out, out.parent / "val.jsonl", predictor=predictor)
    assert result.confusion is None and result.by_label is None
    assert result.metrics["mse"] == pytest.approx(summary["eval"]["mse"], rel=1e-4)


def test_an_undefined_correlation_is_written_as_json_every_reader_reads(tmp_path, caplog, capsys):
    # validation targets all alike: Pearson's and Spearman's correlations are undefined, NaN, for which JSON has
    # no number; Python's json writes NaN, which jq, JavaScript and strict parsers refuse
    rows = make_texts(40, seed=3)
    train = tmp_path / "train.csv"
    train.write_text("text,score\n" + "".join(f"{text},{len(text) % 5}\n" for _, text in rows), encoding="utf-8")
    val = tmp_path / "val.csv"
    val.write_text("text,score\n" + "".join(f"{text} {i},3\n" for i, (_, text) in enumerate(rows[:8])),
                   encoding="utf-8")
    from finetune.start_line import cautions, few_updates

    said = []
    with caplog.at_level(logging.WARNING, logger="finetune"):
        cfg, summary = fit_tiny_run(  # the tiny run's few updates are cautioned of too: tests/test_start_of_run.py
            tmp_path, before_fit=lambda run: said.extend(c for c in cautions(run) if c != few_updates(run)),
            model={"problem_type": "regression"},
            data={"train_file": str(train), "validation_file": str(val), "format": "auto", "has_header": True,
                  "column_names": None, "label_column": "score"},
            evaluation={"metrics": ["pearson", "spearmanr", "mse"], "average": "auto", "positive_label": None},
            training={"num_train_epochs": 1})
    assert math.isnan(summary["eval"]["pearson"]) and math.isfinite(summary["eval"]["mse"])
    # said before training, under the start line, as the data's; not after it as the model's
    assert said == ["the 8 validation rows all have the target 3: pearson and spearmanr over them are undefined "
                    "(nan) whatever the model predicts; give validation rows whose targets differ, or "
                    "evaluation.metrics=[mse,mae]"]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} written as a JSON number"))

    out = tmp_path / "out"
    metrics = strict((out / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["eval"]["pearson"] == metrics["eval"]["spearmanr"] == "nan"
    assert metrics["eval"]["mse"] == summary["eval"]["mse"]
    assert strict((out / "all_results.json").read_text(encoding="utf-8"))["eval_pearson"] == "nan"
    evaluations = [strict(line) for line in (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["eval/pearson"] for r in evaluations if "eval/pearson" in r] == ["nan"]

    # finetune score says the same of a file's targets, and of the model where one text has several targets:
    # whatever number it predicts, it predicts it for every row
    from finetune.score import main as score

    one_text = tmp_path / "one_text.csv"
    # a text the model did not train on: training's texts are counted and warned of apart
    one_text.write_text("text,score\n" + "".join(f"{rows[0][1]} unseen,{target}\n" for target in (1, 2, 4)),
                        encoding="utf-8")
    capsys.readouterr()
    for file in (val, one_text):
        assert score([str(out), "--file", str(file), "--json", str(tmp_path / "s.json")]) == 0
        assert strict((tmp_path / "s.json").read_text(encoding="utf-8"))["metrics"]["pearson"] == "nan"
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")] == [
        "warning: the 8 texts of val.csv all have the target 3: pearson and spearmanr over them are undefined (nan) "
        "whatever the model predicts",
        "warning: the model predicted one number for every one of the 3 texts of one_text.csv, so its pearson and "
        "spearmanr are undefined (nan): its scores are those of answering alike whatever the text (a learning rate "
        "too high or too low, or too few updates?)"]


@pytest.mark.slow
def test_score_against_compares_multi_label_and_regression_models_of_their_own_kind(problem_runs, tmp_path, capsys):
    from finetune.score import main

    report = tmp_path / "score.json"
    for kind in ("multi_label", "regression"):
        out = problem_runs[kind][0]
        reset_accelerate()
        assert main([str(out), "--file", str(out.parent / "val.jsonl"), "--against", str(out), "--json",
                     str(report), "--no-overlap-check"]) == 0
        saved = json.loads(report.read_text())
        # a model against itself: its own scores, every difference 0 with no width
        assert saved["against"]["metrics"] == pytest.approx(
            {k: v for k, v in saved["metrics"].items() if k not in ("loss", "num_samples")}, nan_ok=True)
        assert set(saved["against"]["differences"].values()) <= {0.0} or kind == "regression"
        assert saved["against"]["intervals"] and all(v == [0.0, 0.0] for v in saved["against"]["intervals"].values())
        assert "the interval holds 0" in capsys.readouterr().out
    # a regression model is no answer to a multi-label one
    multi, numbers = problem_runs["multi_label"][0], problem_runs["regression"][0]
    reset_accelerate()
    assert main([str(multi), "--file", str(multi.parent / "val.jsonl"), "--against", str(numbers),
                 "--no-overlap-check"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --against {numbers}: its model is regression, this run's "
                                              f"multi_label")


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_a_regression_output_is_computed_in_float32_under_autocast_in_every_family(model_type):
    """Under bf16 autocast a prediction near 1000 rounds to a multiple of 4: six texts get one answer. The one
    single-output layer of every family computes in float32 instead, its parameters and their names kept; a
    classifier has no such layer and is left as it is."""
    from finetune.tasks import Float32Output, compute_output_in_float32

    model = tiny_model(model_type, num_labels=1).eval()
    model.config.problem_type = "regression"  # as a run's model says it
    names = list(model.state_dict())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.startswith(f"{model.base_model_prefix}.") and name.endswith("bias") and parameter.numel() == 1:
                parameter.fill_(1000.0)
    ids = torch.randint(5, 20, (6, 7), generator=torch.Generator().manual_seed(0))

    def predictions():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids).logits.float().squeeze(-1)

    rounded = predictions()
    assert torch.unique(rounded).numel() == 1  # what autocast's bf16 output makes of them
    name = compute_output_in_float32(model)
    assert isinstance(model.get_submodule(name), Float32Output) and list(model.state_dict()) == names
    exact = predictions()
    assert model(input_ids=ids).logits.dtype == torch.float32
    assert torch.unique(exact).numel() > 1 and (exact - 1000.0).abs().max() < 4  # closer than bf16 can say
    assert compute_output_in_float32(tiny_model(model_type, num_labels=3)) is None


def test_a_bf16_run_on_targets_near_1000_learns_and_scores_what_its_predictions_say(tmp_path):
    """A run sets its regression output to float32 (finetune.tasks.compute_output_in_float32): in bf16, on targets near 1000, its
    validation predictions differ from text to text (rounded to bf16, every one was 1000 or 1004 and the
    correlations undefined)."""
    from helpers import write_tsv

    rng = random.Random(0)
    rows = [(f"{1000 + rng.random() * 3:.3f}", text) for _, text in make_texts(120, seed=7)]
    train, validation = write_tsv(tmp_path / "t.tsv", rows[:96]), write_tsv(tmp_path / "v.tsv", rows[96:])
    seen = {}
    _, summary = fit_tiny_run(
        tmp_path, before_fit=lambda run: seen.update(output=type(run.model.classifier).__name__),
        model={"problem_type": "regression"},
        data={"train_file": str(train), "validation_file": str(validation)},
        training={"mixed_precision": "bf16", "num_train_epochs": 1},
        evaluation={"metrics": ["pearson", "mse"], "average": "auto", "positive_label": None})
    assert seen["output"] == "Float32Output"
    assert math.isfinite(summary["eval"]["pearson"])
