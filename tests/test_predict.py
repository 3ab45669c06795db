"""After training: the saved model in transformers.pipeline, ``finetune.predict`` and ``finetune.score``."""

from __future__ import annotations

import csv
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import forked
from helpers import REPO, RecordingTokenizer, a_fresh_log, make_texts, offline_env, save_tiny_model, write_tsv
from tiny_run import fit_tiny_run, reset_accelerate

# different lengths, so batches are padded and length-sorted
TEXTS = ["free cash prize call now", "see you at dinner tonight", "win",
         "hello ok thanks love you see you later at home tonight good night",
         "urgent claim your offer txt now free free", "sorry late for the meeting"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    cfg, summary = fit_tiny_run(root)
    return root / "out", cfg, summary


@pytest.fixture(scope="module")
def predictor(trained):
    from finetune.predict import Predictor

    out, _, _ = trained
    reset_accelerate()
    return Predictor.load(out)


def test_pipeline_has_the_label_names_and_agrees_with_predict(trained, predictor):
    from transformers import pipeline

    out, _, _ = trained
    classifier = pipeline("text-classification", model=str(out), device="cpu", top_k=None)
    expected = classifier(TEXTS)
    ours = predictor.predict(TEXTS)
    assert predictor.labels == ["ham", "spam"]
    for text, theirs, mine in zip(TEXTS, expected, ours):
        assert {d["label"] for d in theirs} == {"ham", "spam"}
        assert mine["probabilities"] == pytest.approx({d["label"]: d["score"] for d in theirs}, abs=1e-5), text
        assert (mine["label"], mine["score"]) == (theirs[0]["label"], pytest.approx(theirs[0]["score"], abs=1e-5))
    # the model tells these texts apart, so a row put back in the wrong place would show
    spam = [p["probabilities"]["spam"] for p in ours]
    assert max(spam) - min(spam) > 0.1


def test_a_saved_run_predicts_at_its_own_max_length_not_its_tokenizers(trained, predictor):
    from finetune.predict import Predictor

    _, cfg, _ = trained
    long = " ".join(TEXTS * 2)  # past the run's 32 tokens
    assert predictor.max_length == cfg.data.max_length == 32
    assert predictor.tokenizer.model_max_length > 32  # what a Predictor without the run's config would cut at
    cut = Predictor(predictor.model, predictor.tokenizer, max_length=32).logits([long])
    whole = Predictor(predictor.model, predictor.tokenizer).logits([long])
    assert (predictor.logits([long]) == cut).all() and not (cut == whole).all()


def _fixed_logits(tokenizer, logits: list[float], **options):
    """A Predictor whose model gives every text ``logits``: the classifier's weights zero, its bias the logits."""
    import torch

    from finetune.predict import Predictor
    from helpers import tiny_bert

    model = tiny_bert(num_labels=len(logits))
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor(logits))
    return Predictor(model, tokenizer, max_length=16, **options)


def test_probabilities_stay_exact_where_the_logits_are_too_large_to_exponentiate(predictor):
    import math

    far_apart = _fixed_logits(predictor.tokenizer, [1000.0, 0.0, -1000.0])
    assert far_apart.probabilities(TEXTS[:2]).tolist() == [[1.0, 0.0, 0.0]] * 2
    near = _fixed_logits(predictor.tokenizer, [800.0, 800.0 + math.log(3.0)])  # exp(800) is past float64's range
    [prediction] = near.predict(TEXTS[:1])
    assert prediction["label"] == "LABEL_1" and prediction["score"] == pytest.approx(0.75, abs=1e-4)  # float32 logits


def test_the_score_is_the_predicted_labels_probability_where_a_threshold_overrules_the_most_probable(predictor):
    import math

    odds = _fixed_logits(predictor.tokenizer, [0.0, math.log(0.7 / 0.3)], threshold=0.9)  # p(LABEL_1) = 0.7
    [prediction] = odds.predict(TEXTS[:1])
    assert prediction["label"] == "LABEL_0" and prediction["score"] == pytest.approx(0.3)
    assert prediction["probabilities"] == {"LABEL_0": pytest.approx(0.3), "LABEL_1": pytest.approx(0.7)}


def test_batching_and_length_sorting_do_not_change_results(predictor):
    import numpy as np

    predictor.batch_size = 1
    one = predictor.probabilities(TEXTS)
    predictor.batch_size = 4
    four = predictor.probabilities(TEXTS)
    np.testing.assert_allclose(four, one, atol=1e-5)
    np.testing.assert_allclose(one.sum(axis=1), 1.0, atol=1e-6)


def test_shares_of_the_batches_put_together_are_the_logits_bit_for_bit(predictor):
    """``share_of_logits((i, n))`` runs every n-th batch from the i-th of those ``logits`` runs, longest first: the
    shares are disjoint, cover every text once, and their rows are ``logits``' rows, bit for bit, for any n (a test
    set scored by n processes)."""
    import numpy as np

    from finetune.shares import logits_in_order

    predictor.batch_size = 2
    whole = predictor.logits(TEXTS)
    by_length = sorted(range(len(TEXTS)), key=lambda i: -len(predictor.tokenizer(TEXTS[i])["input_ids"]))
    batches = [by_length[start:start + 2] for start in range(0, len(TEXTS), 2)]
    for n in (1, 2, 3, 4):
        shares = [predictor.share_of_logits(TEXTS, None, (i, n)) for i in range(n)]
        for i, (rows, values) in enumerate(shares):
            assert sorted(rows.tolist()) == sorted(sum(batches[i::n], [])), (i, n)
            assert values.shape == (len(rows), 2) and np.array_equal(values, whole[rows])
        assert sorted(np.concatenate([rows for rows, _ in shares]).tolist()) == list(range(len(TEXTS)))
        assert np.array_equal(logits_in_order(shares, len(TEXTS), 2), whole)
    assert len(shares[3][0]) == 0 and shares[3][1].shape == (0, 2)  # 4 processes, 3 batches: one runs none


@pytest.mark.parametrize("truncation", ["head", "chunks"])
def test_batches_padded_by_dataloader_workers_give_the_logits_bit_for_bit(predictor, truncation, monkeypatch):
    """On a GPU, DataLoader workers pad the next batches while the model runs the one before. Forced here on a
    CPU: two workers give the logits of batches padded in the loop, bit for bit, each text in its row (its windows
    averaged under chunks), a share of the batches too; ``auto`` starts none on a CPU, and one batch none."""
    import numpy as np
    import torch.utils.data

    from finetune.predict import Predictor

    started = []

    class Recorded(torch.utils.data.DataLoader):
        def __init__(self, *args, **kwargs):
            started.append(kwargs["num_workers"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.utils.data, "DataLoader", Recorded)
    here = Predictor(predictor.model, predictor.tokenizer, batch_size=2, max_length=8, truncation=truncation)
    ahead = Predictor(predictor.model, predictor.tokenizer, batch_size=2, max_length=8, truncation=truncation,
                      num_workers=2)
    assert here.collating_workers(10) == 0  # auto, on a CPU
    assert [ahead.collating_workers(batches) for batches in (1, 2, 3, 10)] == [0, 1, 2, 2]
    expected = here.logits(TEXTS)
    assert started == []
    logits = ahead.logits(TEXTS)
    assert started == [2] and np.array_equal(logits, expected)  # 3 batches of 2 texts: two workers
    for share in ((0, 2), (1, 2)):
        (rows, values), (rows_ahead, values_ahead) = (p.share_of_logits(TEXTS, None, share) for p in (here, ahead))
        assert np.array_equal(rows_ahead, rows) and np.array_equal(values_ahead, values)
    assert started == [2, 1]  # the shares' two batches and one: a worker, then none


def test_a_launched_process_whose_rows_another_writes_runs_its_batches_and_builds_no_row(predictor):
    """Under a launch every process runs its share of the batches, which they gather together; the first one
    writes the rows. The others run the texts that are not empty, as the first does, and build no row."""
    from finetune.prediction_files import predict_rows

    class Recording:  # the predictor's calls, the model's work left to the real one
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            def call(*args):
                self.calls.append((name, args))
                return getattr(predictor, name)(*args)
            return call

    rows = [{"text": TEXTS[0]}, {"text": "  "}, {"text": TEXTS[1], "id": 7}]
    other, first = Recording(), Recording()
    assert predict_rows(other, rows, "text", kept=False) == []
    assert other.calls == [("logits", ([TEXTS[0], TEXTS[1]], None, False))]
    written = predict_rows(first, rows, "text")
    assert [name for name, _ in first.calls] == ["predict", "empty_prediction"]
    assert first.calls[0][1][0] == [TEXTS[0], TEXTS[1]] and written[2]["id"] == 7 and written[1]["label"] == ""
    assert written[0]["label"] in ("ham", "spam")


@pytest.mark.parametrize("truncation", ["head", "chunks"])
def test_given_every_texts_length_a_share_tokenizes_its_own_texts_alone(predictor, truncation):
    """Processes that share the batches each tokenize an n-th of the texts, whose lengths together are every
    text's (``lengths_across_processes``); given them, a share tokenizes only the texts of its batches, once each,
    and is the share it is when it tokenizes every text, bit for bit (a text cut into windows too)."""
    import numpy as np

    from finetune.predict import Predictor
    from finetune.shares import slice_of

    counting = RecordingTokenizer(predictor.tokenizer)
    cut = Predictor(predictor.model, counting, batch_size=2, max_length=8, truncation=truncation)
    _, lengths = cut.features_of(TEXTS, None, range(len(TEXTS)))
    assert max(lengths) > 8 if truncation == "chunks" else max(lengths) == 8  # the long text: 2 windows, or cut
    for n in (1, 2, 3, 4):
        slices = [cut.features_of(TEXTS, None, slice_of(len(TEXTS), (i, n)))[1] for i in range(n)]
        assert sum(slices, []) == lengths and max(map(len, slices)) - min(map(len, slices)) <= 1
        for i in range(n):
            rows, values = cut.share_of_logits(TEXTS, None, (i, n))
            counting.texts.clear()
            given_rows, given_values = cut.share_of_logits(TEXTS, None, (i, n), lengths=lengths)
            assert sorted(counting.texts) == sorted(TEXTS[row] for row in rows), (i, n)
            assert np.array_equal(given_rows, rows) and np.array_equal(given_values, values)


def test_every_process_learns_every_length_and_processes_holding_other_texts_are_told(monkeypatch):
    """Each process measures its slice; the slices, in process order, are every text's lengths. Processes that
    hold different numbers of texts (each predicting its own) all stop on the same error, before any batch."""
    from finetune import shares

    sent = []

    def gathered(share, processes, to=None):
        sent.append(share)
        return [share, (6, [7, 8, 9])]  # the second process's slice of the same six texts

    monkeypatch.setattr(shares, "shares_of_every_process", gathered)
    assert shares.lengths_across_processes(6, lambda rows: [row * 10 for row in rows], (0, 2)) == [0, 10, 20, 7, 8, 9]
    assert sent == [(6, [0, 10, 20])]  # its slice: the first three rows
    # fewer texts than processes: some measure none, which the tokenizer (refusing an empty batch) is not asked to
    assert [list(shares.slice_of(2, (i, 4))) for i in range(4)] == [[], [0], [], [1]]
    from finetune.truncation import model_features
    assert model_features(None, None, []) == ([], [])
    monkeypatch.setattr(shares, "shares_of_every_process", lambda share, processes, to=None: [share, (5, [1, 1, 1])])
    with pytest.raises(ValueError, match=r"hold different numbers of texts \(\[6, 5\], by process\)"):
        shares.lengths_across_processes(6, lambda rows: [1] * len(rows), (0, 2))


def test_batches_are_padded_as_the_run_padded_its_micro_batches(trained, predictor):
    """To a multiple of ``data.pad_to_multiple_of`` (the run's config: 8), or to the longest text with None; the
    padding is masked, so the logits agree to float rounding."""
    _, cfg, _ = trained
    assert cfg.data.pad_to_multiple_of == 8 and predictor.pad_to_multiple_of == 8  # Predictor.load read it
    widths = []
    hook = predictor.model.register_forward_hook(lambda module, args, kwargs, output: widths.append(
        kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        predictor.batch_size = 4
        padded = predictor.logits(TEXTS)
        eight, widths[:] = list(widths), []
        predictor.pad_to_multiple_of = None
        longest = predictor.logits(TEXTS)
    finally:
        hook.remove()
        predictor.pad_to_multiple_of = 8
    lengths = sorted((len(ids) for ids in predictor.tokenizer(TEXTS)["input_ids"]), reverse=True)
    assert widths == [lengths[i] for i in range(0, len(TEXTS), 4)]  # each batch its longest text, longest first
    assert eight == [-(-w // 8) * 8 for w in widths] and eight != widths
    assert abs(padded - longest).max() < 1e-5


def test_a_wrong_folder_is_said_before_torch_is_imported(tmp_path):
    """``finetune predict`` checks its arguments and the run's folder before importing torch, transformers and
    datasets (seconds): a mistyped folder is answered at once."""
    from helpers import call_in_a_fresh_python

    code, imported, stderr = call_in_a_fresh_python("finetune.predict.main", [str(tmp_path / "nope"), "a text"])
    assert (code, imported) == ("2", []), stderr[-2000:]
    assert stderr.strip() == f"error: {tmp_path / 'nope'}: not found (pass a run's output_dir)"


@pytest.mark.parametrize("command, line", [
    ("finetune.predict.main", "error: --file {file}: not found"),
    ("finetune.score.main", "error: --file: {file} not found"),
])
def test_a_missing_file_is_said_before_torch_is_imported(tmp_path, command, line):
    from helpers import call_in_a_fresh_python

    (tmp_path / "config.json").write_text("{}", encoding="utf-8")  # a run's folder, as far as the checks go
    missing = tmp_path / "held_out.csv"
    code, imported, stderr = call_in_a_fresh_python(command, [str(tmp_path), "--file", str(missing)])
    assert (code, imported) == ("2", []), stderr[-2000:]
    assert stderr.strip() == line.format(file=missing)


def test_cli_texts_print_json_lines(trained):
    out, _, _ = trained
    proc = forked.run([sys.executable, "-m", "finetune.predict", str(out), *TEXTS[:2]], env=offline_env(),
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["text"] for r in lines] == TEXTS[:2]
    assert "predicted" not in proc.stderr  # texts typed on the command line are not summed up: their lines say it all
    for r in lines:
        assert set(r) == {"text", "label", "score", "probabilities"}
        assert r["score"] == max(r["probabilities"].values()) and r["label"] in ("ham", "spam")
        assert sum(r["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)


def test_texts_on_the_command_line_are_classified_without_importing_datasets(trained):
    """datasets reads files (a second to import); texts given as arguments do without it."""
    from helpers import calls_in_a_fresh_python

    out, _, _ = trained
    results, imported, stderr = calls_in_a_fresh_python("finetune.predict.main", [[[str(out), TEXTS[0]]]],
                                                         modules=("torch", "datasets"))
    assert (results, imported) == (["0"], ["torch"]), stderr[-2000:]


def test_standard_input_is_one_text_per_line(trained, predictor, tmp_path):
    # `cat messages.txt | finetune predict RUN --file -`: a line per text, a blank line an empty prediction,
    # UTF-8 whatever the terminal's locale says
    out, _, _ = trained
    lines = [TEXTS[0], "", TEXTS[1] + " caf\u00e9"]
    proc = subprocess.run([sys.executable, "-m", "finetune.predict", str(out), "--file", "-"], cwd=REPO,
                          input=("\n".join(lines) + "\n").encode("utf-8"), env=offline_env({"LC_ALL": "C"}),
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    printed = [json.loads(line) for line in proc.stdout.decode("utf-8").splitlines()]
    assert [r["text"] for r in printed] == lines
    assert printed[1]["label"] == "" and printed[1]["score"] is None
    expected = predictor.predict([lines[0], lines[2]])
    assert [printed[0]["label"], printed[2]["label"]] == [p["label"] for p in expected]
    assert printed[2]["probabilities"] == pytest.approx(expected[1]["probabilities"], abs=1e-5)
    # and into a file
    proc = forked.run([sys.executable, "-m", "finetune.predict", str(out), "--file", "-", "--output",
                       str(tmp_path / "p.jsonl")], input=TEXTS[0], env=offline_env(), timeout=120)
    assert proc.returncode == 0 and json.loads((tmp_path / "p.jsonl").read_text(encoding="utf-8"))["text"] == TEXTS[0]


def _write_inputs(tmp_path):
    txt = tmp_path / "in.txt"
    txt.write_text("\n".join(TEXTS[:3]) + "\n\n", encoding="utf-8")  # a blank line: an empty prediction
    with open(tmp_path / "in.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "message"])
        writer.writerows([[i, t] for i, t in enumerate(TEXTS)])
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return txt, tmp_path / "in.csv", tmp_path / "in.jsonl"


def test_files_in_and_out(trained, predictor, tmp_path, capsys):
    from finetune.predict import main

    out, _, _ = trained
    txt, csv_in, jsonl_in = _write_inputs(tmp_path)
    expected = predictor.predict(TEXTS)

    capsys.readouterr()
    assert main([str(out), "--file", str(txt), "--output", str(tmp_path / "a.csv")]) == 0
    with open(tmp_path / "a.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["text", "label", "score", "prob_ham", "prob_spam"]
    assert [r["text"] for r in rows] == TEXTS[:3] + [""]  # one row per input line, the blank one too
    assert rows[3]["label"] == rows[3]["score"] == rows[3]["prob_spam"] == ""
    for row, p in zip(rows[:3], expected):
        assert row["label"] == p["label"]
        assert float(row["prob_spam"]) == pytest.approx(p["probabilities"]["spam"], abs=1e-5)
    # one line sums the file up: each label's texts, most given first, beside its share of the run's validation
    # texts (the support of its last evaluation); the blank line apart
    by_label = json.loads((out / "metrics.json").read_text())["eval_by_label"]
    support = {name: scores["support"] for name, scores in by_label.items()}
    given = {name: [r["label"] for r in rows[:3]].count(name) for name in ("ham", "spam")}
    ranked = sorted(given, key=lambda name: -given[name])
    shares = [f"{name} {given[name]} ({given[name] / 3:.1%}; validation {support[name] / sum(support.values()):.1%})"
              for name in ranked]
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"3 texts predicted: {', '.join(shares)}; 1 empty text, not predicted -> {tmp_path / 'a.csv'}"
    assert 0 < support["spam"] < sum(support.values())

    capsys.readouterr()
    assert main([str(out), "--file", str(csv_in), "--text", "message", "--output",
                 str(tmp_path / "b.jsonl")]) == 0
    assert "note:" not in capsys.readouterr().err  # no column of the predictions' names, nor the run's labels
    records = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["message"] for r in records] == TEXTS
    assert [r["id"] for r in records] == list(range(len(TEXTS)))  # the input's other columns are kept
    assert [r["label"] for r in records] == [p["label"] for p in expected]

    capsys.readouterr()
    assert main([str(out), "--file", str(jsonl_in), "--batch-size", "2"]) == 0  # no --output: JSON lines on stdout
    captured = capsys.readouterr()
    printed = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["probabilities"] for r in printed] == [pytest.approx(p["probabilities"], abs=1e-5) for p in expected]
    summed = captured.err.splitlines()[-1]  # on stderr, where it leaves the JSON lines as they are, and no file named
    assert summed.startswith("6 texts predicted: ") and "->" not in summed and "empty" not in summed


def test_a_files_predictions_are_summed_up_most_given_label_first(tmp_path):
    """The line's counts, order, shares and the labels past the tenth, on rows made to the purpose."""
    from types import SimpleNamespace

    from finetune.prediction_output import SUMMARY_LABELS, predictions_summary

    labels = [f"c{i}" for i in range(SUMMARY_LABELS + 2)]
    given = [labels[-1]] * 5 + [labels[0]] * 3 + labels[1:-1]  # the last label most, then the first, one of each else
    rows = [{"text": "t", "label": name, "probabilities": {n: 0.1 for n in labels}} for name in given]
    rows.append({"text": "", "label": "", "probabilities": {n: None for n in labels}})  # an empty text
    single = SimpleNamespace(labels=labels, problem_type="single_label")
    (tmp_path / "metrics.json").write_text(json.dumps({
        "eval": {"num_samples": 40}, "eval_by_label": {n: {"support": 4 if n == "c0" else 3} for n in labels}}))
    texts = len(given)
    named = [f"c11 5 ({5 / texts:.1%}; validation {3 / 37:.1%})", f"c0 3 ({3 / texts:.1%}; validation {4 / 37:.1%})"]
    named += [f"c{i} 1 ({1 / texts:.1%}; validation {3 / 37:.1%})" for i in range(1, SUMMARY_LABELS - 1)]
    assert predictions_summary(rows, single, "", tmp_path) == (
        f"{texts} texts predicted: {', '.join(named)}, and 2 more labels 2 ({2 / texts:.1%}); "
        "1 empty text, not predicted")
    # several labels per text: the validation shares are of the texts (40), and the texts given none are counted
    multi = SimpleNamespace(labels=["a", "b"], problem_type="multi_label")
    (tmp_path / "metrics.json").write_text(json.dumps({
        "eval": {"num_samples": 40}, "eval_by_label": {"a": {"support": 10}, "b": {"support": 30}}}))
    rows = [{"labels": tags, "probabilities": {"a": 0.5, "b": 0.5}} for tags in (["b"], ["a", "b"], [], ["b"])]
    assert predictions_summary(rows, multi, "", tmp_path, "out.csv") == (
        "4 texts predicted: b 3 (75.0%; validation 75.0%), a 1 (25.0%; validation 25.0%); no label 1 (25.0%) "
        "-> out.csv")
    # a folder without metrics.json (a model trained elsewhere): the counts alone
    assert predictions_summary(rows, multi, "", tmp_path / "elsewhere") == \
        "4 texts predicted: b 3 (75.0%), a 1 (25.0%); no label 1 (25.0%)"


def test_split_classifies_the_rows_of_one_split_alone_in_their_order(trained, predictor, tmp_path, capsys):
    """``--split test`` keeps the rows whose column of splits holds ``test`` (spaces around it aside), each
    predicted as it is alone; a folder of the splits ``datasets`` saved gives the split's folder."""
    import datasets

    from finetune.predict import main

    out, _, _ = trained
    splits = ["train", " test", "validation", "test ", "train", "test"]
    with open(tmp_path / "all.csv", "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([["message", "part"], *zip(TEXTS, splits)])
    tested = [text for text, split in zip(TEXTS, splits) if split.strip() == "test"]
    assert main([str(out), "--file", str(tmp_path / "all.csv"), "--text", "message", "--split", "test",
                 "--split-column", "part", "--output", str(tmp_path / "test.csv")]) == 0
    with open(tmp_path / "test.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [(row["message"], row["part"].strip()) for row in rows] == [(text, "test") for text in tested]
    expected = predictor.predict(tested)
    assert [row["label"] for row in rows] == [p["label"] for p in expected]
    assert [float(row["prob_spam"]) for row in rows] == \
        [pytest.approx(p["probabilities"]["spam"], abs=1e-5) for p in expected]
    capsys.readouterr()
    assert main([str(out), "--file", str(tmp_path / "all.csv"), "--text", "message", "--split", "tset",
                 "--split-column", "part"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --split: {tmp_path / 'all.csv'}'s column 'part' has no "
                                               f"split 'tset' (splits: train, test, validation)")

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:2]}),
                          "test": datasets.Dataset.from_dict({"text": tested})}).save_to_disk(str(saved))
    assert main([str(out), "--file", str(saved), "--split", "test"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["text"] for row in printed] == tested and [row["label"] for row in printed] == \
        [p["label"] for p in expected]
    assert main([str(out), "--file", str(saved), "--split", "validation"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --split: {saved} has no split 'validation' (splits: test, train)"


def test_a_headerless_file_like_the_runs_is_read_as_the_run_read_its_own(trained, predictor, tmp_path, capsys):
    """The run read headerless TSV files (label, text); a file of the same layout is classified row by row, its
    first line too, and said so; a file whose header names the text column is read by its header."""
    from finetune.predict import main

    out, _, _ = trained
    labels = ["spam", "ham", "spam", "ham", "spam", "ham"]
    plain = write_tsv(tmp_path / "held_out.tsv", list(zip(labels, TEXTS)))
    assert main([str(out), "--file", str(plain), "--output", str(tmp_path / "p.csv")]) == 0
    assert capsys.readouterr().err.startswith(f"note: {plain}: its first line names no column 'text': read as the "
                                              f"run's data was, without a header, its columns label, text\n")
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [(row["label"], row["text"]) for row in rows] == list(zip(labels, TEXTS))  # the file's own labels kept
    assert [row["predicted_label"] for row in rows] == [p["label"] for p in predictor.predict(TEXTS)]
    headed = tmp_path / "headed.tsv"
    headed.write_text("text\tlabel\n" + "".join(f"{t}\t{label}\n" for t, label in zip(TEXTS, labels)),
                      encoding="utf-8")
    assert main([str(out), "--file", str(headed), "--output", str(tmp_path / "q.csv")]) == 0
    assert "its first line names no column" not in capsys.readouterr().err
    with open(tmp_path / "q.csv", newline="", encoding="utf-8") as fh:
        assert [row["text"] for row in csv.DictReader(fh)] == TEXTS


def test_a_compressed_file_predicts_and_scores_as_the_file_it_holds(trained, tmp_path, capsys):
    import gzip
    import lzma

    from finetune.predict import main
    from finetune.score import main as score

    out, _, _ = trained
    for plain, packed in zip(_write_inputs(tmp_path), ("in.txt.gz", "in.csv.xz", "in.jsonl.gz")):
        (tmp_path / packed).write_bytes((gzip if packed.endswith(".gz") else lzma).compress(plain.read_bytes()))
        given = ["--text", "message"] if ".csv" in packed else []
        for name in (plain.name, packed):
            assert main([str(out), "--file", str(tmp_path / name), *given, "--output",
                         str(tmp_path / f"{name}.csv")]) == 0, capsys.readouterr().err
        assert (tmp_path / f"{packed}.csv").read_text() == (tmp_path / f"{plain.name}.csv").read_text()
    labelled = write_tsv(tmp_path / "held_out.tsv", make_texts(12, seed=4))
    (tmp_path / "held_out.tsv.gz").write_bytes(gzip.compress(labelled.read_bytes()))
    capsys.readouterr()
    for name in ("held_out.tsv", "held_out.tsv.gz"):
        assert score([str(out), "--file", str(tmp_path / name), "--json", str(tmp_path / f"{name}.json")]) == 0
    plain, packed = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("held_out.tsv", "held_out.tsv.gz"))
    assert packed.pop("file").endswith(".tsv.gz") and plain.pop("file").endswith(".tsv")
    assert packed == plain and sum(map(sum, plain["confusion_matrix"])) == 12
    assert capsys.readouterr().out.count(f"confusion matrix: {out / 'confusion_held_out.png'}") == 2


def test_a_url_predicts_and_scores_as_the_file_it_names(trained, tmp_path, capsys, downloads):
    from finetune.predict import main
    from finetune.score import main as score
    from helpers import serving

    out, _, _ = trained
    site = tmp_path / "site"
    site.mkdir()
    txt, _, _ = _write_inputs(site)
    write_tsv(site / "held_out.tsv", make_texts(12, seed=4))
    with serving(site) as (url, _):
        assert main([str(out), "--file", f"{url}/in.txt", "--output", str(tmp_path / "url.csv")]) == 0
        assert main([str(out), "--file", str(txt), "--output", str(tmp_path / "local.csv")]) == 0
        assert (tmp_path / "url.csv").read_text() == (tmp_path / "local.csv").read_text()
        capsys.readouterr()
        assert score([str(out), "--file", f"{url}/held_out.tsv", "--json", str(tmp_path / "url.json")]) == 0
        printed = capsys.readouterr().out
        assert main([str(out), "--file", f"{url}/in.csv", "--text", "body"]) == 2  # named as given
        assert capsys.readouterr().err.strip() == (f"error: --file {url}/in.csv: no column 'body' in the header "
                                                   "(id, message); pass --text")
    assert printed.startswith(f"{url}/held_out.tsv: 12 samples")  # named by its URL, not by the downloaded copy
    assert f"confusion matrix: {out / 'confusion_held_out.png'}" in printed
    assert score([str(out), "--file", str(site / "held_out.tsv"), "--json", str(tmp_path / "local.json")]) == 0
    remote, local = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("url", "local"))
    assert remote.pop("file") == f"{url}/held_out.tsv" and local.pop("file") == str(site / "held_out.tsv")
    assert remote == local


def test_lines_are_texts_whatever_the_runs_text_column(trained, predictor, tmp_path, capsys):
    import shutil

    from finetune.predict import main

    out = Path(shutil.copytree(trained[0], tmp_path / "run"))
    saved = out / "config.yaml"  # a run that trained on a file whose texts are in a column named 'sentence'
    saved.write_text(saved.read_text(encoding="utf-8").replace("text_column: text", "text_column: sentence"),
                     encoding="utf-8")
    txt = tmp_path / "texts.txt"
    txt.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    assert main([str(out), "--file", str(txt)]) == 0, capsys.readouterr().err
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in printed] == TEXTS
    assert [r["label"] for r in printed] == [p["label"] for p in predictor.predict(TEXTS)]
    assert main([str(out), "--file", str(txt), "--text", "sentence"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --text 'sentence': names a column; {txt} holds one text per line"
    # tab-split lines, not the run's two columns, whose first names a column 'text', not the run's: a text a line,
    # as the checks above took it, its first line too (telling the kind again for a column 'text' read a table)
    lines = ["text\tsource\tlanguage", *(f"{text}\tsms\ten" for text in TEXTS)]
    txt.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main([str(out), "--file", str(txt)]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["text"] for line in captured.out.splitlines()] == lines and "note:" not in captured.err


def test_a_files_quotes_read_as_the_runs_data_quoting_says_unless_quoting_is_given(trained, tmp_path, capsys):
    """A TSV file that never quotes, a stray quote in it closed by a later one before a tab: a run that read its
    data with `data.quoting: none` reads the files it predicts so too, and `--quoting` says otherwise. What the
    read found is a note or a warning on stderr, in predict's words and score's."""
    import shutil

    from finetune.predict import main
    from finetune.score import main as score

    out = Path(shutil.copytree(trained[0], tmp_path / "run"))
    saved = out / "config.yaml"
    assert saved.read_text(encoding="utf-8").count("quoting: auto") == 1
    saved.write_text(saved.read_text(encoding="utf-8").replace("quoting: auto", "quoting: none"), encoding="utf-8")
    texts = ['"free cash prize', "see you at dinner", "call now", 'a 5"', "sorry late"]
    glue = tmp_path / "glue.tsv"
    glue.write_text("text\tsource\n" + "".join(f"{text}\tsms\n" for text in texts), encoding="utf-8")
    with a_fresh_log():
        assert main([str(out), "--file", str(glue)]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["text"] for line in captured.out.splitlines()] == texts
    assert "quoted over several lines" not in captured.err
    with a_fresh_log():
        assert main([str(out), "--file", str(glue), "--quoting", "auto"]) == 0  # CSV's rule: the lines between, one
    captured = capsys.readouterr()
    assert [json.loads(line)["text"] for line in captured.out.splitlines()] == [
        "free cash prize\tsms\nsee you at dinner\tsms\ncall now\tsms\na 5", "sorry late"]
    assert (f"warning: {glue}: 1 row's text is quoted over several lines (the first on line 2), read by CSV's rule "
            "as pandas writes a TSV file; where the file never quotes, --quoting none reads its quotes as plain "
            "characters (--quoting csv: it is written so)\n") in captured.err
    with pytest.raises(SystemExit) as exit_:
        main([str(out), "--file", str(glue), "--quoting", "plain"])
    assert exit_.value.code == 2 and "--quoting: invalid choice: 'plain' (choose from" in capsys.readouterr().err
    # score reads as the run read, or as data.quoting=... says; R's row numbers are left out, in a note
    labelled = tmp_path / "labelled.tsv"
    labelled.write_text("text\tlabel\n" + "".join(f"{i}\t{text}\t{'spam' if i % 2 else 'ham'}\n"
                                                  for i, text in enumerate(texts)), encoding="utf-8")
    with a_fresh_log():
        assert score([str(out), "--file", str(labelled)]) == 0
    printed, err = capsys.readouterr()
    assert f"{labelled}: 5 samples" in printed and "quoted over several lines" not in err
    assert (f"note: {labelled}: left out the first field of each row, which the header does not name: the row "
            "numbers R's write.table writes (row.names = TRUE)\n") in err
    with a_fresh_log():
        assert score([str(out), "--file", str(labelled), "data.quoting=auto"]) == 0
    printed, err = capsys.readouterr()
    assert f"{labelled}: 2 samples" in printed and "(the first on line 2), read by CSV's rule" in err
    assert "data.quoting=none reads its quotes as plain characters" in err


def test_the_predict_bar_redraws_in_a_terminal_and_seldom_into_a_log_file(trained, monkeypatch):
    """Into a batch job's log, where every redraw stays on one line, the bar is drawn at its start and its end, not
    at tqdm's pace in a terminal (batches of 2 texts, each forward pass made to take 0.15 s)."""
    import io
    import time

    from finetune.predict import Predictor

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    reset_accelerate()
    slow = Predictor.load(trained[0], batch_size=2)
    slow.model.register_forward_hook(lambda *_: time.sleep(0.15))
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    drawn = {}
    for name, stream in (("terminal", Terminal()), ("file", io.StringIO())):
        monkeypatch.setattr(sys, "stderr", stream)
        slow.logits(TEXTS, progress=True)
        drawn[name] = [draw for draw in stream.getvalue().split("\r") if "text" in draw]
    # a terminal: its start, each of the 3 batches (and its close); a file: its start and its close alone
    assert len(drawn["terminal"]) >= 4 and len(drawn["file"]) == 2, drawn
    assert "6/6" in drawn["file"][-1] and "0/6" in drawn["file"][0]


def test_a_txt_file_of_a_tables_lines_is_read_by_its_columns_as_training_reads_it(trained, predictor, tmp_path,
                                                                                     capsys):
    """Training reads a .txt whose lines split on tabs alike as TSV; so does predict, where its first line names
    the text column, rather than classify each line, its header and labels too, as a text. A .txt of texts, one
    holding a tab, is still a text a line."""
    from finetune.predict import main

    out, _, _ = trained
    table = tmp_path / "table.txt"
    table.write_text("label\tmessage\n" + "".join(f"{i % 2}\t{text}\n" for i, text in enumerate(TEXTS)),
                     encoding="utf-8")
    assert main([str(out), "--file", str(table), "--text", "message"]) == 0
    captured = capsys.readouterr()
    printed = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["message"] for r in printed] == TEXTS and [r["label"] for r in printed] == [0, 1] * 3  # as read
    assert [r["predicted_label"] for r in printed] == [p["label"] for p in predictor.predict(TEXTS)]
    assert f"note: {table}: its lines split on tabs alike, as a table's: read as training reads such a file, by " \
           "its columns" in captured.err
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(TEXTS[:2] + ["one\ttab"] + TEXTS[2:]) + "\n", encoding="utf-8")
    assert main([str(out), "--file", str(lines)]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["text"] for line in captured.out.splitlines()] == TEXTS[:2] + ["one\ttab"] + TEXTS[2:]
    assert "note:" not in captured.err


def test_a_list_or_mapping_column_is_written_to_csv_as_json(trained, tmp_path):
    from finetune.predict import main

    out, _, _ = trained
    rows = [{"text": text, "tags": ["spam", "ads"][: i % 2 + 1], "meta": {"id": i, "src": "ünï"}}
            for i, text in enumerate(TEXTS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert main([str(out), "--file", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "p.csv")]) == 0
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as fh:
        written = list(csv.DictReader(fh))
    assert [json.loads(r["tags"]) for r in written] == [r["tags"] for r in rows]  # not Python's ['spam']
    assert [json.loads(r["meta"]) for r in written] == [r["meta"] for r in rows]


def test_predictions_go_to_tsv_and_read_back_as_written(trained, predictor, tmp_path):
    """A .tsv output quotes a text that holds a tab, a line break or a quote as CSV does (as pandas writes TSV):
    the readers of training data and pandas read its texts back as they were."""
    import pandas as pd

    from finetune.prediction_files import read_rows
    from finetune.predict import main

    out, _, _ = trained
    texts = ['she said "hi" twice', "a\ttab", "two\nlines", '"quoted whole"', TEXTS[0]]
    pd.DataFrame({"id": range(len(texts)), "message": texts}).to_csv(tmp_path / "in.tsv", sep="\t", index=False)
    assert main([str(out), "--file", str(tmp_path / "in.tsv"), "--text", "message",
                 "--output", str(tmp_path / "out.tsv")]) == 0
    written = (tmp_path / "out.tsv").read_text(encoding="utf-8")
    assert written.startswith("id\tmessage\tlabel\tscore\tprob_ham\tprob_spam\n") and '"a\ttab"' in written
    expected = predictor.predict(texts)
    for rows in (read_rows(tmp_path / "out.tsv", "message"),
                 pd.read_csv(tmp_path / "out.tsv", sep="\t").to_dict("records")):
        assert [row["message"] for row in rows] == texts
        assert [row["label"] for row in rows] == [p["label"] for p in expected]
        assert [float(row["prob_spam"]) for row in rows] == pytest.approx(
            [p["probabilities"]["spam"] for p in expected], abs=1e-6)


def test_predictions_go_to_parquet_as_to_csv_with_the_inputs_own_types(trained, predictor, tmp_path):
    """The CSV's columns, each of its own type (the input's dates and numbers too); a column of numbers and texts
    as their texts, as the CSV holds them; a blank text's row with nulls."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    from finetune.predict import main

    out, _, _ = trained
    expected = predictor.predict(TEXTS)
    day = datetime.date(2026, 12, 2)
    pq.write_table(pa.table({"text": TEXTS + [""], "sent": [day] * (len(TEXTS) + 1),
                             "id": list(range(len(TEXTS) + 1))}), tmp_path / "in.parquet")
    assert main([str(out), "--file", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "p.parquet")]) == 0
    table = pq.read_table(tmp_path / "p.parquet")
    assert table.column_names == ["text", "sent", "id", "label", "score", "prob_ham", "prob_spam"]
    assert (table.schema.field("sent").type, table.schema.field("id").type) == (pa.date32(), pa.int64())
    rows = table.to_pylist()
    assert [r["label"] for r in rows[:-1]] == [p["label"] for p in expected]
    assert [r["prob_spam"] for r in rows[:-1]] == pytest.approx([p["probabilities"]["spam"] for p in expected],
                                                                abs=1e-6)
    assert (rows[-1]["label"], rows[-1]["score"], rows[-1]["prob_spam"]) == ("", None, None)

    # a JSON column of numbers and texts: as the values read (datasets 5 keeps 7 and "x7"; 4 reads their JSON)
    mixed = [{"text": text, "ref": [7, "x7", None][i % 3]} for i, text in enumerate(TEXTS)]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed), encoding="utf-8")
    for name in ("m.parquet", "m.jsonl"):
        assert main([str(out), "--file", str(tmp_path / "mixed.jsonl"), "--output", str(tmp_path / name)]) == 0
    read = [json.loads(line)["ref"] for line in (tmp_path / "m.jsonl").read_text(encoding="utf-8").splitlines()]
    assert pq.read_table(tmp_path / "m.parquet").column("ref").to_pylist() == [None if v is None else str(v)
                                                                                for v in read]


def test_predictions_go_to_a_workbook_as_to_csv_each_number_a_number(trained, predictor, tmp_path, capsys):
    """A workbook in, a workbook out: the input's columns and the predicted ones, numbers as numbers; a text that
    starts with '=' stays a text, not a formula, and a control character a workbook cannot hold is U+FFFD."""
    import openpyxl

    from finetune.predict import main

    out, _, _ = trained
    expected = predictor.predict(TEXTS)
    book = openpyxl.Workbook()
    book.active.append(["text", "id"])
    for i, text in enumerate(TEXTS):
        book.active.append([text, i])
    book.active.append(["=1+1 is two", 99])
    book.active.cell(len(TEXTS) + 2, 1).data_type = "s"  # a text, as a user who typed '=1+1 is two has it
    book.save(tmp_path / "in.xlsx")
    assert main([str(out), "--file", str(tmp_path / "in.xlsx"), "--output", str(tmp_path / "p.xlsx")]) == 0
    sheet = openpyxl.load_workbook(tmp_path / "p.xlsx").active
    rows = [[cell.value for cell in row] for row in sheet.iter_rows()]
    assert sheet.title == "predictions" and rows[0] == ["text", "id", "label", "score", "prob_ham", "prob_spam"]
    assert [row[:3] for row in rows[1:-1]] == [[text, i, p["label"]] for i, (text, p) in enumerate(zip(TEXTS,
                                                                                                       expected))]
    assert [row[5] for row in rows[1:-1]] == pytest.approx([p["probabilities"]["spam"] for p in expected], abs=1e-6)
    assert rows[-1][:2] == ["=1+1 is two", 99] and sheet.cell(len(rows), 1).data_type == "s"
    # another sheet, by --sheet; a sheet the workbook lacks, or --sheet beside a file of another kind, is one line
    book.create_sheet("other").append(["text"])
    book["other"].append([TEXTS[0]])
    book.save(tmp_path / "in.xlsx")
    assert main([str(out), "--file", str(tmp_path / "in.xlsx"), "--sheet", "other", "--output",
                 str(tmp_path / "o.csv")]) == 0
    capsys.readouterr()
    assert (tmp_path / "o.csv").read_text(encoding="utf-8").splitlines()[1].startswith(f"{TEXTS[0]},")
    assert main([str(out), "--file", str(tmp_path / "in.xlsx"), "--sheet", "Other"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'in.xlsx'}: no sheet 'Other' (--sheet); its "
                                               "sheets: Sheet, other")
    assert main([str(out), "--file", str(tmp_path / "o.csv"), "--sheet", "other"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --sheet: names a sheet of an .xlsx --file, and "
                                               f"{tmp_path / 'o.csv'} is not one")
    (tmp_path / "bell.jsonl").write_text(json.dumps({"text": "ring \x07 twice"}) + "\n", encoding="utf-8")
    assert main([str(out), "--file", str(tmp_path / "bell.jsonl"), "--output", str(tmp_path / "b.xlsx")]) == 0
    assert openpyxl.load_workbook(tmp_path / "b.xlsx").active.cell(2, 1).value == "ring \ufffd twice"


def test_a_folder_of_text_files_is_classified_a_file_a_text(trained, predictor, tmp_path, capsys):
    """A folder of documents, or of classes (``ham/1.txt``) as training reads it: each ``.txt`` file a row, named by
    its path in the folder, read whole; other files, and hidden ones, left out."""
    from finetune.predict import main

    out, _, _ = trained
    folder = tmp_path / "docs"
    names = ["a.txt", "ham/2.txt", "spam/1.txt"]
    for name, text in zip(names, TEXTS):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text + "\n", encoding="utf-8")
    (folder / "notes.md").write_text("not a text to classify", encoding="utf-8")
    (folder / ".ipynb_checkpoints").mkdir()  # a notebook's copy: hidden, as training's class folders leave it
    (folder / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text(TEXTS[0], encoding="utf-8")
    assert main([str(out), "--file", str(folder), "--output", str(tmp_path / "p.jsonl")]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["file"] for r in rows] == names
    assert [r["text"] for r in rows] == [text + "\n" for text in TEXTS[:3]]
    assert [r["label"] for r in rows] == [p["label"] for p in predictor.predict([t + "\n" for t in TEXTS[:3]])]
    assert main([str(out), "--file", str(folder), "--text", "body"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --text 'body': names a column; {folder} holds one text per file"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("no text to classify", encoding="utf-8")
    (tmp_path / "empty" / ".ipynb_checkpoints").mkdir()  # a hidden .txt file is not a text to classify
    (tmp_path / "empty" / ".ipynb_checkpoints" / "notes-checkpoint.txt").write_text("hidden", encoding="utf-8")
    assert main([str(out), "--file", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --file {tmp_path / 'empty'}: a folder without .txt files, and "
                                               "not one that datasets' save_to_disk wrote (give a file: .txt, .csv, "
                                               ".tsv, .tab, .json, .jsonl, .parquet, .xlsx, .xlsm)")
    (folder / "a.txt").write_bytes(b"caf\xe9")
    assert main([str(out), "--file", str(folder)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[0] == (f"error: {folder / 'a.txt'}: not UTF-8 text (byte offset "
                                                               "3); set --encoding to the file's")


def test_every_format_training_reads_can_be_classified(trained, predictor, tmp_path, capsys):
    import datetime

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from finetune.predict import main

    out, _, _ = trained
    expected = [p["label"] for p in predictor.predict(TEXTS)]
    (tmp_path / "in.json").write_text(json.dumps([{"message": t, "n": i} for i, t in enumerate(TEXTS)]),
                                      encoding="utf-8")
    sent = [datetime.datetime(2026, 1, 1 + i) for i in range(len(TEXTS))]
    pq.write_table(pa.table({"message": TEXTS, "sent": sent}), tmp_path / "in.parquet")
    datasets.Dataset.from_dict({"message": TEXTS, "n": list(range(len(TEXTS)))}).save_to_disk(tmp_path / "saved")
    (tmp_path / "in.tab").write_text("n\tmessage\tfrom\n" + "".join(f"{i}\t{t}\tsms\n" for i, t in enumerate(TEXTS)),
                                     encoding="utf-8")  # training's other name for TSV
    for name, kept in (("in.json", "n"), ("in.parquet", "sent"), ("saved", "n"), ("in.tab", "n")):
        assert main([str(out), "--file", str(tmp_path / name), "--text", "message", "--output",
                     str(tmp_path / f"{name}.jsonl")]) == 0, capsys.readouterr().err
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
        assert [r["label"] for r in records] == expected and [r["message"] for r in records] == TEXTS
        assert [r[kept] for r in records] == ([*range(len(TEXTS))] if kept == "n" else [str(t) for t in sent])
    capsys.readouterr()
    assert main([str(out), "--file", str(tmp_path / "in.parquet"), "--text", "body"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --file {tmp_path / 'in.parquet'}: no column 'body' among the "
                                               "columns (message, sent); pass --text")
    assert main([str(out), "--file", str(tmp_path / "in.tab"), "--text", "body"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --file {tmp_path / 'in.tab'}: no column 'body' in the header "
                                               "(n, message, from); pass --text")


def test_score_prints_the_most_confused_pairs_where_a_matrix_would_not_fit(trained, tmp_path, capsys, monkeypatch):
    import numpy as np

    import finetune.score
    from finetune.score import Score, main
    from finetune.score_tables import PRINTED_MATRIX_LABELS

    out, _, _ = trained
    names = [f"intent_{i}" for i in range(PRINTED_MATRIX_LABELS + 1)]
    matrix = np.diag(np.full(len(names), 5))
    matrix[3, 7], matrix[0, 1], matrix[12, 0] = 4, 9, 1  # three mistakes: 9, then 4, then 1
    scored = Score(str(tmp_path / "intents.csv"), {"num_samples": int(matrix.sum()), "accuracy": 0.5}, names, matrix,
                   None, None)
    monkeypatch.setattr(finetune.score, "score_file", lambda *args, **kwargs: scored)
    write_tsv(tmp_path / "intents.csv", [("ham", "hello")])  # looked for before scoring
    assert main([str(out), "--file", str(tmp_path / "intents.csv"), "--png", str(tmp_path / "m.png")]) == 0
    printed = capsys.readouterr().out
    assert "confusion matrix (rows" not in printed
    assert ("most confused (true label -> predicted label: texts; 3 pairs in all)\n  intent_0 -> intent_1: 9\n"
            "  intent_3 -> intent_7: 4\n  intent_12 -> intent_0: 1\n") in printed
    few = Score(scored.file, scored.metrics, names[:2], np.array([[3, 1], [0, 2]]), None, None)
    monkeypatch.setattr(finetune.score, "score_file", lambda *args, **kwargs: few)
    assert main([str(out), "--file", str(tmp_path / "intents.csv"), "--png", str(tmp_path / "m.png")]) == 0
    printed = capsys.readouterr().out
    assert "confusion matrix (rows: true label, columns: predicted label)" in printed and "most confused" not in printed


def test_a_semicolon_separated_file_gets_its_predictions_separated_alike(trained, predictor, tmp_path):
    from finetune.predict import main

    out, _, _ = trained
    (tmp_path / "excel.csv").write_text("id;message\n" + "".join(f"{i};{t}\n" for i, t in enumerate(TEXTS)),
                                        encoding="utf-8")
    assert main([str(out), "--file", str(tmp_path / "excel.csv"), "--text", "message", "--output",
                 str(tmp_path / "p.csv")]) == 0
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter=";"))
    assert list(rows[0]) == ["id", "message", "label", "score", "prob_ham", "prob_spam"]
    assert [r["label"] for r in rows] == [p["label"] for p in predictor.predict(TEXTS)]


def test_a_labelled_files_own_label_and_score_are_kept_beside_the_predictions(trained, predictor, tmp_path, capsys):
    from finetune.predict import main

    out, _, _ = trained
    truth = ["spam" if "free" in text else "ham" for text in TEXTS]
    with open(tmp_path / "test.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label", "score"])
        writer.writerows([[text, label, i] for i, (text, label) in enumerate(zip(TEXTS, truth))])
    expected = predictor.predict(TEXTS)

    assert main([str(out), "--file", str(tmp_path / "test.csv"), "--output", str(tmp_path / "p.csv")]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")] == [
        f"note: {tmp_path / 'test.csv'} has its own 'label' and 'score' columns, kept as they are: the prediction's "
        "columns are named predicted_<name> (predicted_label, predicted_score, ...)",
        f"note: {tmp_path / 'test.csv'} has the run's label column 'label': finetune score {out} --file "
        f"{tmp_path / 'test.csv'} scores the model on it"]
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["text", "label", "score", "predicted_label", "predicted_score", "predicted_prob_ham",
                             "predicted_prob_spam"]
    assert [r["label"] for r in rows] == truth and [r["score"] for r in rows] == [str(i) for i in range(len(TEXTS))]
    assert [r["predicted_label"] for r in rows] == [p["label"] for p in expected]
    assert [float(r["predicted_prob_spam"]) for r in rows] == pytest.approx(
        [p["probabilities"]["spam"] for p in expected], abs=1e-5)

    assert main([str(out), "--file", str(tmp_path / "test.csv"), "--output", str(tmp_path / "p.jsonl")]) == 0
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["label"] for r in records] == truth
    assert [r["predicted_label"] for r in records] == [p["label"] for p in expected]
    assert [r["predicted_probabilities"] for r in records] == [pytest.approx(p["probabilities"], abs=1e-5)
                                                                for p in expected]
    # the predictions file given back (to compare another model, say): its predicted_ columns are kept too, and
    # the new ones take the next free prefix
    capsys.readouterr()
    assert main([str(out), "--file", str(tmp_path / "p.csv"), "--output", str(tmp_path / "again.csv")]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"note: {tmp_path / 'p.csv'} has its own 'label', 'score', 'predicted_label', 'predicted_prob_ham', "
        "'predicted_prob_spam' and 'predicted_score' columns, kept as they are: the prediction's columns are named "
        "predicted_2_<name> (predicted_2_label, predicted_2_score, ...)")
    with open(tmp_path / "again.csv", newline="", encoding="utf-8") as fh:
        again = list(csv.DictReader(fh))
    assert list(again[0]) == list(rows[0]) + ["predicted_2_label", "predicted_2_score", "predicted_2_prob_ham",
                                              "predicted_2_prob_spam"]
    assert [{k: r[k] for k in rows[0]} for r in again] == rows
    assert [r["predicted_2_label"] for r in again] == [p["label"] for p in expected]


@pytest.mark.parametrize("suffix", [".csv", ".txt"])
def test_a_file_in_another_encoding_is_read_in_the_encoding_given(trained, tmp_path, capsys, suffix):
    from finetune.predict import main

    out, _, _ = trained
    texts = ["café gratuit", "naïve Straße"]
    path = tmp_path / f"windows{suffix}"
    path.write_text("".join(f"{t}\n" for t in (["text"] if suffix == ".csv" else []) + texts), encoding="cp1252")
    assert main([str(out), "--file", str(path)]) == 2  # the run's data.encoding, UTF-8 here
    assert capsys.readouterr().err.strip().splitlines()[0].startswith(
        f"error: {'--file ' if suffix == '.txt' else ''}{path}: not UTF-8 text (byte offset "
        f"{path.read_bytes().index(0xE9)}); ")
    assert main([str(out), "--file", str(path), "--encoding", "cp1252", "--output", str(tmp_path / "p.jsonl")]) == 0
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in records] == texts  # written out as UTF-8, every accent kept


def test_a_text_file_not_in_its_encoding_is_one_line_naming_the_files_own_offset(trained, tmp_path, capsys):
    """Past the reader's first buffer the offset is still the file's, in UTF-8 and in another encoding."""
    from finetune.predict import main

    out, _, _ = trained
    long = tmp_path / "long.txt"
    long.write_bytes(b"free cash now\n" * 2000 + b"caf\xe9\n")
    assert main([str(out), "--file", str(long)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --file {long}: not UTF-8 text (byte offset {28003}); set --encoding to the file's",
        "hint: a spreadsheet's plain CSV on Windows is --encoding cp1252"]
    wide = tmp_path / "wide.txt"
    wide.write_bytes(("free cash now\n" * 2000).encode("utf-16") + b"\x00")  # half a character at its end
    assert main([str(out), "--file", str(wide), "--encoding", "utf-16"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --file {wide}: not utf-16 text (byte offset {2 + 2 * 28000}); set --encoding to the file's"]
    wide.write_bytes("free cash now\n".encode("utf-16-le"))  # no byte-order mark: refused, as data.py's reader does
    assert main([str(out), "--file", str(wide), "--encoding", "utf-16"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --file {wide}: not utf-16 text (byte offset 0); set --encoding to the file's"]


@pytest.mark.parametrize("args, message", [
    (["--file", "{tmp}/in.csv"],
     "error: --file {tmp}/in.csv: no column 'text' in the header (id, message); pass --text"),
    (["--file", "{tmp}/in.csv", "--text", "Message"],  # a name in another case: the hint names the file's own
     "error: --file {tmp}/in.csv: no column 'Message' in the header (id, message); pass --text\n"
     "hint: by the name, try --text message"),
    (["--file", "{tmp}/in.txt", "--output", "{tmp}/x.xls"],
     "error: --output {tmp}/x.xls: unsupported extension '.xls' (use .csv, .tsv, .jsonl, .parquet, .xlsx)"),
    (["--file", "{tmp}/missing.txt"], "error: --file {tmp}/missing.txt: not found"),
    (["--file", "http://127.0.0.1:9/texts.csv"],  # offline, as the suite is: never downloaded, nothing to read
     "error: --file: cannot download http://127.0.0.1:9/texts.csv: OfflineModeIsEnabled: Offline mode is enabled. "
     "Tried to reach http://127.0.0.1:9/texts.csv\nhint: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: unset it "
     "for the download, which later runs reuse"),
    ([], "error: nothing to classify: give texts or --file"),
    (["--text", "Shares fell sharply."], "error: --text 'Shares fell sharply.': names a column of a --file; texts "
     "to classify follow the run's folder: finetune predict {out} \"a text\""),
    (["a text", "--text-pair", "second"], "error: --text-pair 'second': names a column of a --file; "
     "texts to classify follow the run's folder: finetune predict {out} \"a text\""),
    (["--file", "{tmp}/in.csv", "--text-column", "message", "--output", "{tmp}/./in.csv"],
     "error: --output {tmp}/./in.csv: is the --file being classified; name another file"),
    (["--file", "{tmp}/in.txt", "--precision", "fp8"],
     "error: --precision: must be one of no, bf16, fp16, auto, got 'fp8'"),
    (["--file", "{tmp}/in.txt", "--encoding", "klingon"],
     "error: --encoding: 'klingon' is no text encoding Python knows (utf-8, cp1252, latin-1, utf-16, ...)"),
    (["a text", "--encoding", "cp1252"], "error: --encoding cp1252: only with --file"),
    (["--file", "{tmp}/in.txt", "--precision", "fp16"],
     "error: precision fp16: needs a CUDA GPU, the model is on cpu (use bf16 or no)"),
    (["a text", "--split", "test"], "error: --split test: names a split of a --file's rows; give the --file"),
    (["--file", "{tmp}/in.csv", "--text", "message", "--split-column", "part"],
     "error: --split-column part: names the column --split reads; give --split too"),
    (["--file", "{tmp}/in.txt", "--split", "test"],
     "error: --split test: names a split of a file's rows, and {tmp}/in.txt holds single texts"),
    (["--file", "{tmp}/in.csv", "--text", "message", "--split", "test"],  # the run was trained without a column
     "error: --split test: the run names no column of splits (data.split_column); name the file's with "
     "--split-column"),
    (["--file", "{tmp}/in.csv", "--text", "message", "--split", "test", "--split-column", "part"],
     "error: --file {tmp}/in.csv: no column 'part' of splits (--split-column, else the run's data.split_column); "
     "columns found: id, message"),
])
def test_bad_input_is_one_line(trained, tmp_path, capsys, args, message):
    from finetune.predict import main

    out, _, _ = trained
    inputs = _write_inputs(tmp_path)
    before = [path.read_bytes() for path in inputs]
    assert main([str(out)] + [a.format(tmp=tmp_path) for a in args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == message.format(tmp=tmp_path, out=out).splitlines()
    assert [path.read_bytes() for path in inputs] == before


@pytest.mark.parametrize("command", ["predict", "score"])
def test_out_of_memory_is_one_line_whose_hint_is_followed_until_it_fits(trained, tmp_path, capsys, monkeypatch,
                                                                       command):
    import importlib

    import torch

    from finetune.predict import Predictor

    original = Predictor.logits

    def logits(self, *args, **kwargs):  # a device with room for batches of 8 texts
        if self.batch_size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Predictor, "logits", logits)
    main = importlib.import_module(f"finetune.{command}").main
    out, _, _ = trained
    labelled = make_texts(20, seed=5)
    if command == "score":
        args = [str(out), "--file", str(write_tsv(tmp_path / "texts.tsv", labelled)), "data.format=tsv"]
    else:  # one text per line
        (tmp_path / "texts.txt").write_text("".join(text + "\n" for _, text in labelled), encoding="utf-8")
        args = [str(out), "--file", str(tmp_path / "texts.txt")]
    batch, codes = 32, []
    while True:
        codes.append(main([*args, "--batch-size", str(batch)]))
        err = capsys.readouterr().err.strip().splitlines()
        if codes[-1] == 0:
            break
        assert err == [f"error: out of memory at --batch-size {batch}, on the longest texts (they run first)",
                       f"hint: --batch-size {batch // 2}"]
        batch = int(err[1].split()[-1])
    assert codes == [5, 5, 0] and batch == 8


def test_options_may_come_between_texts(trained, capsys):
    from finetune.predict import main

    out, _, _ = trained
    assert main([str(out), TEXTS[0], "--batch-size", "1", TEXTS[1]]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == TEXTS[:2]


def test_not_a_model_directory(tmp_path, capsys):
    from finetune.predict import main

    assert main([str(tmp_path), "hello"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: no model here (no config.json); pass a run's output_dir"
    # a run stopped before its end has checkpoints and no model: the newest checkpoint is named (by its number)
    for update in (9, 10):
        (tmp_path / "checkpoints" / f"checkpoint-{update}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"checkpoint-{update}" / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / ".tmp-checkpoint-11").mkdir()  # one being written: no model yet
    assert main([str(tmp_path), "hello"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[1] == (
        "hint: its run has saved no model yet (stopped, or still training); its newest checkpoint holds one: "
        f"{tmp_path / 'checkpoints' / 'checkpoint-10'}")


def test_a_threshold_for_a_model_of_three_classes_is_refused_not_ignored(tmp_path, capsys):
    """A model of more than two classes predicts its most probable: a --threshold would change nothing it said.
    (Two classes: tests/test_decision_threshold.py.)"""
    from finetune.errors import ConfigError
    from finetune.predict import Predictor, main

    out = save_tiny_model(tmp_path / "three", num_labels=3)
    (tmp_path / "texts.txt").write_text("win cash now\n", encoding="utf-8")
    capsys.readouterr()  # what saving the tiny model said
    assert main([str(out), "--threshold", "0.1", "--file", str(tmp_path / "texts.txt"), "--output",
                 str(tmp_path / "p.csv")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --threshold: applies to multi_label models and to single_label ones of two classes; this one "
        "is single_label, which predicts its most probable of 3 classes (LABEL_0, LABEL_1, LABEL_2)")
    assert not (tmp_path / "p.csv").exists()
    with pytest.raises(ConfigError, match="threshold 0.3: applies to multi_label models"):
        Predictor.load(out, threshold=0.3)


def test_score_refuses_an_unknown_precision_in_one_line(trained, tmp_path, capsys):
    from finetune.score import main

    out, cfg, _ = trained
    held_out = tmp_path / "held_out_fp8.tsv"
    held_out.write_bytes(Path(cfg.data.validation_file).read_bytes())
    assert main([str(out), "--file", str(held_out), "--precision", "fp8"]) == 2
    assert capsys.readouterr().err.strip() == "error: --precision: must be one of no, bf16, fp16, auto, got 'fp8'"
    assert not (out / "confusion_held_out_fp8.png").exists()


def test_a_run_trained_on_a_fold_scores_every_row_of_a_file(trained, predictor, tmp_path):
    """A run's folds cut its training data; the file given to score is scored whole."""
    import shutil

    from finetune.score import score_file

    out, cfg, _ = trained
    run = Path(shutil.copytree(out, tmp_path / "run"))
    saved = run / "config.yaml"
    text = saved.read_text(encoding="utf-8")
    assert "validation_folds: null" in text and "validation_fold: 1" in text
    text = re.sub(r"validation_file: .*", "validation_file: null", text)
    saved.write_text(text.replace("validation_folds: null", "validation_folds: 3")
                     .replace("validation_fold: 1", "validation_fold: 2"), encoding="utf-8")
    result = score_file(run, cfg.data.validation_file, predictor=predictor)
    assert result.metrics["num_samples"] == 40


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_score_reproduces_the_validation_metrics(trained, predictor):
    from finetune.score import score_file

    out, cfg, summary = trained
    result = score_file(out, cfg.data.validation_file, predictor=predictor)
    final = summary["eval"]
    assert result.labels == ["ham", "spam"]
    assert result.metrics["num_samples"] == final["num_samples"] == 40
    for name in ("accuracy", "f1", "matthews_correlation"):
        assert result.metrics[name] == pytest.approx(final[name], abs=1e-9), name
    assert result.metrics["loss"] == pytest.approx(final["loss"], rel=1e-5)
    matrix = result.confusion
    assert matrix.sum() == 40 and matrix.trace() / 40 == pytest.approx(final["accuracy"])
    assert list(matrix.sum(axis=1)) == [sum(1 for label, _ in make_texts(40, seed=4) if label == name)
                                        for name in ("ham", "spam")]


def test_bf16_predictions_are_computed_under_bf16_autocast(trained, predictor):
    """``precision="bf16"``: the model's forward runs under bf16 autocast (its logits move off float32's by
    bf16's rounding, not by more: the labels stay), and comes back as float32."""
    import torch

    from finetune.predict import Predictor

    out, _, _ = trained
    fast = Predictor.load(out, precision="bf16")
    seen = []
    fast.model.register_forward_hook(
        lambda module, args, output: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                                                  output.logits.dtype)))
    exact, rounded = predictor.logits(TEXTS), fast.logits(TEXTS)
    assert seen and all(s == (True, torch.bfloat16, torch.bfloat16) for s in seen)
    assert rounded.dtype == exact.dtype == "float32"
    assert not (rounded == exact).all()
    assert abs(rounded - exact).max() < 0.05 and (rounded.argmax(1) == exact.argmax(1)).all()


def test_auto_precision_is_what_training_would_choose_on_the_device(trained, monkeypatch, capsys):
    """``precision="auto"`` computes in bf16 where the hardware computes it faster than float32, as training's
    ``auto`` decides (a CPU with AMX), and in float32 where it does not (a CPU without bf16 units); a command says
    the choice, and a score records it."""
    import numpy as np

    from finetune import precisions
    from finetune.predict import Predictor, main
    from finetune.score import score_file

    out, cfg, _ = trained
    monkeypatch.setattr(precisions, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    fast = Predictor.load(out, precision="auto")
    assert fast.precision == "bf16"
    np.testing.assert_array_equal(fast.logits(TEXTS), Predictor.load(out, precision="bf16").logits(TEXTS))
    # bf16's rounding, so that the test tells the two apart
    assert not (fast.logits(TEXTS) == Predictor.load(out, precision="no").logits(TEXTS)).all()
    assert score_file(out, cfg.data.validation_file, precision="auto").precision == "bf16"
    with a_fresh_log():
        assert main([str(out), "--precision", "auto", "a text"]) == 0
    assert "note: precision bf16 (auto: the CPU computes bf16 (amx_bf16))\n" in capsys.readouterr().err
    monkeypatch.setattr(precisions, "cpu_flags", lambda: {"avx2"})
    exact = Predictor.load(out, precision="auto")
    assert exact.precision == "no" and exact.autocast is None
    np.testing.assert_array_equal(exact.logits(TEXTS), Predictor.load(out, precision="no").logits(TEXTS))


def test_score_in_the_runs_bf16_reproduces_its_validation_metrics(tmp_path, capsys):
    """A bf16 run's metrics.json comes from evaluations under bf16 autocast. Scoring its validation file in
    bf16, in the evaluation's batches (all 40 texts, longest first), gives its loss to the last digit; in
    float32 the loss moves by float32's distance from bf16."""
    from finetune.score import score_file

    cfg, summary = fit_tiny_run(tmp_path, training={"mixed_precision": "bf16"})
    evaluated = summary["eval"]
    result = score_file(cfg.output.output_dir, cfg.data.validation_file, precision="bf16", batch_size=64)
    assert result.precision == "bf16" and result.to_dict()["precision"] == "bf16"
    assert result.metrics["loss"] == pytest.approx(evaluated["loss"], rel=1e-12)
    for name in ("accuracy", "f1", "matthews_correlation"):
        assert result.metrics[name] == evaluated[name], name
    reset_accelerate()
    exact = score_file(cfg.output.output_dir, cfg.data.validation_file, precision="no", batch_size=64)
    assert exact.metrics["loss"] != pytest.approx(evaluated["loss"], rel=1e-5)
    from finetune.score import main

    reset_accelerate()
    report = tmp_path / "score.json"
    assert main([str(cfg.output.output_dir), "--file", str(cfg.data.validation_file), "--precision", "bf16",
                 "--json", str(report)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(": 40 samples, computed in bf16 autocast; f1: of 'spam'")
    assert json.loads(report.read_text())["precision"] == "bf16"


def test_the_text_column_flag_is_named_as_trains_and_keeps_its_longer_name():
    from finetune.predict import parse_args

    assert parse_args(["out", "--text", "body"]).text_column == "body"
    assert parse_args(["out", "--text-column", "body"]).text_column == "body"


def test_score_cli(trained, tmp_path, capsys):
    from finetune.score import main

    out, _, _ = trained
    # a CSV with a header, one class only, a format the run did not train on
    rows = [(label, text) for label, text in make_texts(30, seed=8) if label == "spam"]
    with open(tmp_path / "spam.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["message", "class"])
        writer.writerows([(text, label) for label, text in rows])
    png, report = tmp_path / "cm.png", tmp_path / "score.json"
    # --text and --label, as `finetune train --data` takes them: the header names them, so it is read by it
    assert main([str(out), "--file", str(tmp_path / "spam.csv"), "--png", str(png), "--json", str(report),
                 "--text", "message", "--label", "class", "evaluation.metrics=[accuracy,recall]"]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(report.read_text())
    assert saved["metrics"]["num_samples"] == len(rows)
    assert set(saved["metrics"]) == {"loss", "num_samples", "accuracy", "recall"}
    # whose recall it is: the run's positive class, the rarer of its two
    assert printed.splitlines()[0].startswith(f"{tmp_path / 'spam.csv'}: {len(rows)} samples")
    assert printed.splitlines()[0].endswith("; recall: of 'spam'")
    assert saved["confusion_matrix"][0] == [0, 0] and sum(saved["confusion_matrix"][1]) == len(rows)
    assert "confusion matrix (rows: true label, columns: predicted label)" in printed
    spam_row = next(line for line in printed.splitlines() if line.startswith("spam ") and "." not in line)
    assert [int(x) for x in spam_row.split()[1:]] == saved["confusion_matrix"][1]
    # each label alone, from the same predictions: spam's recall is the file's accuracy (it holds spam only),
    # and ham, never true, has no recall and a precision of 0 when predicted at all
    spam, ham = saved["by_label"]["spam"], saved["by_label"]["ham"]
    hits = saved["confusion_matrix"][1][1]
    assert spam["support"] == len(rows) and ham["support"] == 0
    assert spam["recall"] == pytest.approx(saved["metrics"]["accuracy"]) == pytest.approx(hits / len(rows))
    assert spam["precision"] == (1.0 if hits else 0.0) and ham["recall"] == 0.0 and ham["precision"] == 0.0
    table = printed.split("by label (each scored alone; support: its texts in the file; predicted: the texts given "
                          "it)\n")[1].splitlines()
    assert table[0].split() == ["label", "precision", "recall", "f1", "support", "predicted"]
    assert table[2].split() == ["spam", f"{spam['precision']:.4f}", f"{spam['recall']:.4f}", f"{spam['f1']:.4f}",
                                str(len(rows)), str(hits)]
    assert spam["predicted"] == hits and ham["predicted"] == len(rows) - hits  # the confusion matrix's columns
    # each metric with its bootstrap interval, printed and in the JSON; one of a point said to be no certainty
    assert set(saved["intervals"]) == {"accuracy", "recall"}
    for name, (low, high) in saved["intervals"].items():
        assert low <= saved["metrics"][name] <= high
        line = next(line for line in printed.splitlines() if line.split()[:1] == [name])
        assert line.endswith(f"{saved['metrics'][name]:.4f}  (95% interval {low:.4f} to {high:.4f})")
    # no width exactly where no resample can differ: every text right, or every text wrong
    accuracy = saved["metrics"]["accuracy"]
    low, high = saved["intervals"]["accuracy"]
    assert (high - low > 0) == (0 < accuracy < 1)
    assert ("An interval of one point means that no resample moved the metric" in printed) == (low == high)
    width, height = png_size(png)
    assert width > 200 and height > 200

    # a label the model never saw: one line naming the file and row, and the model's labels as the model's (it may
    # be a model this package did not train); one in another case, with a hint
    bad = write_tsv(tmp_path / "bad.tsv", [("ham", "hello there"), ("eggs", "free cash")])
    assert main([str(out), "--file", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}: label 'eggs' at line 2 not among the 2 labels of the model (ham, spam)"]
    shouted = write_tsv(tmp_path / "shouted.tsv", [("ham", "hello there"), ("SPAM", "free cash")])
    assert main([str(out), "--file", str(shouted)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[1] == (
        "hint: the model writes it 'spam': labels are told apart by case; write them as the model does, or name both "
        "with data.label_map")
    # the default PNG goes next to the model, named after the file: not written on error
    assert not (out / "confusion_bad.png").exists()
    assert main([str(out), "--file", str(bad), "training.seed=3"]) == 2
    assert "scoring reads only data.<key> and evaluation.<key>" in capsys.readouterr().err


def test_a_header_naming_the_text_column_twice_is_refused_as_training_refuses_it(trained, tmp_path, capsys):
    from finetune.predict import main

    out, _, _ = trained
    twice = tmp_path / "twice.csv"
    twice.write_text("text,id,text\nfree cash now,1,see you\n", encoding="utf-8")
    assert main([str(out), "--file", str(twice)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --file {twice}: the header names 'text' in fields 1 and 3, so the texts could be either",
        "hint: rename one of them in the header"]
    # a repeated column it does not read is no matter
    (tmp_path / "ids.csv").write_text("id,text,id\n1,free cash now,2\n", encoding="utf-8")
    assert main([str(out), "--file", str(tmp_path / "ids.csv")]) == 0


def test_a_json_file_pandas_wrote_by_columns_is_not_classified_as_one_text(trained, tmp_path, capsys):
    import pandas as pd

    from finetune.predict import main

    out, _, _ = trained
    path = tmp_path / "pd.json"
    pd.DataFrame({"text": TEXTS}).to_json(path)  # pandas' default: one mapping per column
    assert main([str(out), "--file", str(path)]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said[0] == f"error: --file {path}: a table written by columns, not rows"


def test_a_json_object_whose_rows_sit_under_one_key_gets_a_prediction_per_record(trained, predictor, tmp_path,
                                                                                   capsys):
    from finetune.predict import main

    out, _, _ = trained
    path = tmp_path / "export.json"
    path.write_text(json.dumps({"version": 1, "results": [{"message": text} for text in TEXTS]}), encoding="utf-8")
    assert main([str(out), "--file", str(path), "--text", "message"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["message"] for r in printed] == TEXTS
    assert [r["label"] for r in printed] == [p["label"] for p in predictor.predict(TEXTS)]
    # one line of JSON Lines holding the --text column is a row, whatever lists it holds
    path.write_text(json.dumps({"message": TEXTS[0], "spans": [{"start": 0}]}) + "\n", encoding="utf-8")
    assert main([str(out), "--file", str(path), "--text", "message"]) == 0
    assert [json.loads(line)["message"] for line in capsys.readouterr().out.splitlines()] == TEXTS[:1]


def test_a_column_of_lists_or_mappings_is_not_classified_as_texts(trained, tmp_path, capsys):
    from finetune.predict import main

    out, _, _ = trained
    path = tmp_path / "tagged.jsonl"
    path.write_text("".join(json.dumps({"text": [text], "meta": {"id": i}, "body": text}) + "\n"
                            for i, text in enumerate(TEXTS)), encoding="utf-8")
    for column, held in (("text", "List values"), ("meta", "dict values")):
        assert main([str(out), "--file", str(path), "--text", column]) == 2  # their JSON was classified
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: --file {path}: column {column!r} holds {held}, not texts",
            "hint: name the column of the texts with --text"]
    assert main([str(out), "--file", str(path), "--text", "body"]) == 0
    assert [json.loads(line)["body"] for line in capsys.readouterr().out.splitlines()] == TEXTS


def test_score_warns_when_every_text_got_the_same_answer(trained, tmp_path, capsys):
    from finetune.score import main

    out, _, _ = trained
    # one text, under both labels: whatever the model answers, it answers it for every row
    same = write_tsv(tmp_path / "same.tsv", [("spam", TEXTS[0])] * 3 + [("ham", TEXTS[0])] * 2)
    assert main([str(out), "--file", str(same), "--json", str(tmp_path / "s.json")]) == 0
    by_label = json.loads((tmp_path / "s.json").read_text())["by_label"]
    given = next(name for name, scores in by_label.items() if scores["predicted"] == 5)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: the model predicted {given!r} for every one of the 5 texts of same.tsv: its scores are those "
        "of answering alike whatever the text (a learning rate too high or too low, or too few updates?)"]
    # the two labels answered apart: nothing to warn of
    apart = write_tsv(tmp_path / "apart.tsv", [("spam", TEXTS[0]), ("ham", TEXTS[1]), ("spam", TEXTS[4])])
    assert main([str(out), "--file", str(apart), "--json", str(tmp_path / "a.json")]) == 0
    predicted = [s["predicted"] for s in json.loads((tmp_path / "a.json").read_text())["by_label"].values()]
    assert ("warning:" in capsys.readouterr().err) == (sorted(predicted) == [0, 3])


def test_a_file_read_with_the_runs_layout_says_so_when_it_fails(trained, tmp_path, capsys):
    from finetune.score import main

    out, _, _ = trained
    # a header that does not name the run's columns: the file is read as the run's headerless TSV was
    other = tmp_path / "other.csv"
    other.write_text("message,class\nhello there,ham\n", encoding="utf-8")
    assert main([str(out), "--file", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {other}: line 1 has 1 field but data.column_names has 2 (label, text)",
                   "hint: read as the run's data was (format: tsv; no header; columns label, text); a CSV/TSV "
                   "file whose header names 'text' and 'label' is read by its header, or set data.format, "
                   "data.has_header and data.column_names"]


def test_a_file_with_its_own_header_is_scored_in_the_runs_encoding(tmp_path):
    """The header names the columns, so the run's format, header and column names go; how the bytes are written
    it cannot say, so the run's data.encoding stays (and data.encoding= on the command line replaces it)."""
    import yaml

    from finetune.score import scoring_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {
        "train_file": "train.tsv", "format": "tsv", "has_header": False, "column_names": ["label", "text"],
        "encoding": "cp1252"}}))
    labelled = tmp_path / "held_out.csv"
    labelled.write_text("text,label\ncafé,ham\n", encoding="cp1252")
    data = scoring_config(run, labelled).data
    assert (data.format, data.has_header, data.column_names, data.encoding) == ("auto", True, None, "cp1252")
    assert scoring_config(run, labelled, ["data.encoding=latin-1"]).data.encoding == "latin-1"


@pytest.mark.parametrize("name", ["held_out.jsonl", "held_out.jsonl.gz", "held_out.json", "held_out.parquet",
                                  "held_out.xlsx", "held_out/"])
def test_a_file_of_its_own_layout_is_read_by_it_not_the_runs(tmp_path, name):
    """The run trained on a headerless TSV file (the default job's SMS file): its format and column names describe
    that file, and a JSON Lines, JSON or Parquet file to score names its columns by its keys, a folder by its
    sub-folders (or the features datasets saved)."""
    import yaml

    from finetune.score import scoring_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {
        "train_file": "train.tsv", "format": "tsv", "has_header": False, "column_names": ["label", "text"]}}))
    (tmp_path / "held_out.tsv").write_bytes(b"")  # looked for, not read
    (tmp_path / name).mkdir() if name.endswith("/") else (tmp_path / name).write_bytes(b"")
    data = scoring_config(run, tmp_path / name).data
    assert (data.format, data.has_header, data.column_names) == ("auto", True, None)
    assert scoring_config(run, tmp_path / "held_out.tsv").data.format == "tsv"  # a file like the training file
    if name.endswith(".xlsx"):  # a run's sheet is where its rows were, which a header does not say: it stays
        (run / "config.yaml").write_text(yaml.safe_dump({"data": {"train_file": "train.xlsx", "sheet": "Data"}}))
        assert scoring_config(run, tmp_path / name).data.sheet == "Data"


def test_the_default_jobs_model_scores_a_json_lines_and_a_parquet_file_and_a_folder(trained, tmp_path, capsys):
    """Read with the run's headerless TSV layout, a JSON Lines file was one field per line, and a folder of classes
    was refused ('a folder but data.format is tsv')."""
    import pandas as pd

    from finetune.score import main

    out, _, _ = trained
    rows = [{"text": TEXTS[0], "label": "spam"}, {"text": TEXTS[1], "label": "ham"}]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pd.DataFrame(rows).to_parquet(tmp_path / "held_out.parquet")
    for row in rows:
        (tmp_path / "classes" / row["label"]).mkdir(parents=True)
        (tmp_path / "classes" / row["label"] / "1.txt").write_text(row["text"], encoding="utf-8")
    for name in ("held_out.jsonl", "held_out.parquet", "classes"):
        assert main([str(out), "--file", str(tmp_path / name), "--json", str(tmp_path / f"{name}.json")]) == 0, \
            capsys.readouterr().err
        scored = json.loads((tmp_path / f"{name}.json").read_text())
        assert scored["metrics"]["num_samples"] == 2
        assert {label: s["support"] for label, s in scored["by_label"].items()} == {"ham": 1, "spam": 1}


def test_the_runs_own_files_are_never_an_output(trained, tmp_path, capsys):
    from finetune import predict, score

    out, _, _ = trained
    labelled = write_tsv(tmp_path / "held_out.tsv", [("ham", "hello there"), ("spam", "free cash")])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for main, flag, name in ((score.main, "--json", "config.yaml"), (score.main, "--json", "tokenizer.json"),
                             (score.main, "--png", "curves.png"), (score.main, "--json", "checkpoints/x.json"),
                             (predict.main, "--output", "train_log.jsonl")):
        assert main([str(out), "--file", str(labelled), flag, str(out / name)]) == 2
        assert capsys.readouterr().err.strip() == (f"error: {flag} {out / name}: is a file of the run in {out}; "
                                                   f"name another file")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # a file of the user's own in the run's folder is written as asked
    assert score.main([str(out), "--file", str(labelled), "--json", str(out / "held_out.json")]) == 0
    assert json.loads((out / "held_out.json").read_text())["metrics"]["num_samples"] == 2
    for made in (out / "held_out.json", out / "confusion_held_out.png"):
        made.unlink()


def test_an_output_that_is_a_directory_or_no_picture_is_refused_before_anything_is_scored(trained, tmp_path,
                                                                                          capsys):
    from finetune import predict, score

    out, _, _ = trained
    labelled = write_tsv(tmp_path / "held_out.tsv", [("ham", "hello there"), ("spam", "free cash")])
    (tmp_path / "pictures").mkdir()
    (tmp_path / "table.csv").mkdir()
    for main, flag, target, said in (
            (score.main, "--png", tmp_path / "pictures", "is a directory; name a file"),  # was written as pictures.png
            (score.main, "--json", tmp_path / "pictures", "is a directory; name a file"),  # was a traceback at the end
            (score.main, "--png", tmp_path / "confusion.5", "not a picture format matplotlib writes (.png, .pdf, "
                                                            ".svg, ...)"),  # was a traceback after the scoring
            (predict.main, "--output", tmp_path / "table.csv", "is a directory; name a file")):
        assert main([str(out), "--file", str(labelled), flag, str(target)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {flag} {target}: {said}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held_out.tsv", "pictures", "table.csv"]
    assert not list((tmp_path / "pictures").iterdir()) and not list((tmp_path / "table.csv").iterdir())
    # a name without a suffix is a PNG of that name, as the line says
    assert score.main([str(out), "--file", str(labelled), "--png", str(tmp_path / "confusion")]) == 0
    assert f"confusion matrix: {tmp_path / 'confusion'}" in capsys.readouterr().out
    assert (tmp_path / "confusion").read_bytes()[:4] == b"\x89PNG"


def test_text_pairs_match_the_pipeline(trained, predictor):
    """Sentence pairs go through the tokenizer as pairs (token_type_ids 1 on the second text)."""
    from transformers import pipeline

    out, _, _ = trained
    firsts, seconds = TEXTS[:3], TEXTS[3:]
    classifier = pipeline("text-classification", model=str(out), device="cpu", top_k=None)
    expected = classifier([{"text": a, "text_pair": b} for a, b in zip(firsts, seconds)])
    probs = predictor.probabilities(firsts, seconds)
    for row, theirs in zip(probs, expected):
        assert dict(zip(predictor.labels, row.tolist())) == pytest.approx({d["label"]: d["score"] for d in theirs},
                                                                        abs=1e-5)
    assert not (probs == predictor.probabilities(firsts)).all()  # the second text is really used


def _tsv_texts(path: Path) -> list[str]:
    return [line.split("\t", 1)[1] for line in path.read_text(encoding="utf-8").splitlines()]


def test_score_counts_the_texts_the_model_trained_on(trained, tmp_path, capsys, monkeypatch):
    from finetune.score import main

    out, cfg, _ = trained
    train_file, validation_file = Path(cfg.data.train_file), Path(cfg.data.validation_file)
    trained_texts = set(_tsv_texts(train_file))
    # the training file itself: every row, and a warning
    assert main([str(out), "--file", str(train_file), "--json", str(tmp_path / "t.json")]) == 0
    printed, err = capsys.readouterr()
    rows = len(_tsv_texts(train_file))
    assert json.loads((tmp_path / "t.json").read_text())["seen_in_training"] == rows
    assert printed.splitlines()[0] == (f"{train_file}: {rows} samples, {rows} of them a text the model trained on; "
                                       "f1: of 'spam'")
    assert (f"warning: {rows} of the {rows} texts of {train_file.name} are texts the model trained on: their scores "
            "say what it remembers, not how it does on texts it has not seen") in err.splitlines()
    # the validation file: the texts it shares with the training file, counted here from the files themselves
    assert main([str(out), "--file", str(validation_file), "--json", str(tmp_path / "v.json")]) == 0
    shared = sum(text in trained_texts for text in _tsv_texts(validation_file))
    assert json.loads((tmp_path / "v.json").read_text())["seen_in_training"] == shared
    # a file of one training text and nine new ones: counted, under the share that is warned of
    fresh = [(label, f"{text} unseen {i}") for i, (label, text) in enumerate(make_texts(9, seed=11))]
    mixed = write_tsv(tmp_path / "mixed.tsv", [("ham", next(iter(trained_texts)))] + fresh)
    capsys.readouterr()
    assert main([str(out), "--file", str(mixed)]) == 0
    printed, err = capsys.readouterr()
    assert printed.splitlines()[0] == f"{mixed}: 10 samples, 1 of them a text the model trained on; f1: of 'spam'"
    assert "trained on" not in err
    # asked not to: the training rows are not read again, and nothing is counted or said
    import finetune.score

    read_again = []
    real = finetune.score.texts_seen_in_training
    monkeypatch.setattr(finetune.score, "texts_seen_in_training", lambda *a, **k: read_again.append(a) or real(*a, **k))
    assert main([str(out), "--file", str(train_file), "--no-overlap-check", "--json", str(tmp_path / "n.json")]) == 0
    printed, err = capsys.readouterr()
    assert read_again == [] and json.loads((tmp_path / "n.json").read_text())["seen_in_training"] is None
    assert printed.splitlines()[0] == f"{train_file}: {rows} samples; f1: of 'spam'" and "trained on" not in err


def test_score_counts_seen_texts_only_where_the_training_rows_are_the_runs_own(trained, tmp_path, capsys):
    import shutil

    import yaml

    from finetune.score import main

    out, cfg, _ = trained
    train_file = Path(cfg.data.train_file)
    copy = tmp_path / "run"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoints"))
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    metrics = json.loads((copy / "metrics.json").read_text())

    def score_with_training_file(lines: list[str]):
        moved = tmp_path / "moved.tsv"
        moved.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        saved["data"]["train_file"] = str(moved)
        (copy / "config.yaml").write_text(yaml.safe_dump(saved))
        metrics["train"]["data_file"] = str(moved)  # as if the run had read its rows there
        (copy / "metrics.json").write_text(json.dumps(metrics))
        assert main([str(copy), "--file", str(train_file), "--json", str(tmp_path / "s.json")]) == 0, \
            capsys.readouterr().err
        return json.loads((tmp_path / "s.json").read_text())["seen_in_training"], capsys.readouterr()

    lines = train_file.read_text(encoding="utf-8").splitlines()
    # the same rows elsewhere: found by what they hold, not where they are
    seen, _ = score_with_training_file(lines)
    assert seen == len(lines)
    # a file edited since the run: not its training rows, so nothing is counted or said
    seen, (printed, err) = score_with_training_file(lines[:-1] + ["ham\tedited since"])
    assert seen is None
    assert printed.splitlines()[0] == f"{train_file}: {len(lines)} samples; f1: of 'spam'"
    assert "trained on" not in err
    # the file gone: the same
    (tmp_path / "moved.tsv").unlink()
    assert main([str(copy), "--file", str(train_file), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["seen_in_training"] is None


def test_score_finds_a_relative_training_path_from_another_folder(trained, tmp_path, capsys, monkeypatch):
    import shutil

    import yaml

    from finetune.score import main

    out, cfg, _ = trained
    train_file = Path(cfg.data.train_file)
    recorded = json.loads((out / "metrics.json").read_text())["train"]["data_file"]
    assert recorded == str(train_file.resolve())
    copy = tmp_path / "run"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoints"))
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    saved["data"]["train_file"] = train_file.name  # as a user gives it, from the folder the run started in
    (copy / "config.yaml").write_text(yaml.safe_dump(saved))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rows = len(train_file.read_text(encoding="utf-8").splitlines())

    def seen() -> int:
        assert main([str(copy), "--file", str(train_file), "--json", str(tmp_path / "s.json")]) == 0, \
            capsys.readouterr().err
        return json.loads((tmp_path / "s.json").read_text())["seen_in_training"]

    # nothing of that name here: the absolute path metrics.json holds finds the rows
    assert seen() == rows
    # another file of that name here: not the run's rows, and the absolute path still finds them
    write_tsv(elsewhere / train_file.name, make_texts(6, seed=5))
    assert seen() == rows
    # without the absolute path (a run from before it was recorded), the file here is not taken for the run's
    metrics = json.loads((copy / "metrics.json").read_text())
    del metrics["train"]["data_file"]
    (copy / "metrics.json").write_text(json.dumps(metrics))
    assert seen() is None


def test_predict_and_score_read_a_file_in_an_archive(trained, downloads, tmp_path, capsys, monkeypatch):
    import zipfile

    from finetune.predict import main as predict
    from finetune.resources import training_file
    from finetune.score import main as score

    out, _, _ = trained
    rows = "text,label\n" + "".join(f"{text},{label}\n" for label, text in make_texts(12, seed=5))
    with zipfile.ZipFile(tmp_path / "contest.zip", "w") as packed:
        packed.writestr("test.csv", rows)
        packed.writestr("train.csv", rows)
    monkeypatch.chdir(tmp_path)
    assert predict([str(out), "--file", "contest.zip/test.csv", "--output", "predicted.csv"]) == 0
    predicted = list(csv.DictReader(open(tmp_path / "predicted.csv", encoding="utf-8")))
    assert [row["text"] for row in predicted] == [text for _, text in make_texts(12, seed=5)]
    assert {row["predicted_label"] for row in predicted} <= {"ham", "spam"}
    assert score([str(out), "--file", "contest.zip/test.csv"]) == 0
    assert "12" in capsys.readouterr().out  # its rows, all scored
    # a run on a file in an archive records where that is, for score to find it again from any folder
    assert training_file("contest.zip/train.csv") == f"{(tmp_path / 'contest.zip').resolve()}/train.csv"


def test_score_against_another_model_gives_each_difference_with_its_paired_interval(trained, tmp_path, capsys):
    from finetune.score import main

    out, _, _ = trained
    earlier = sorted((out / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[0]
    data = write_tsv(tmp_path / "held.tsv", make_texts(60, seed=11))
    report = tmp_path / "score.json"
    assert main([str(out), "--file", str(data), "--against", str(earlier), "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(report.read_text())
    against = saved["against"]
    assert against["against"] == str(earlier) and set(against["metrics"]) == set(saved["intervals"])
    for name, difference in against["differences"].items():
        assert difference == pytest.approx(saved["metrics"][name] - against["metrics"][name], abs=1e-12)
        low, high = against["intervals"][name]
        assert -2 <= low <= high <= 2
        line = next(line for line in printed.split("this - other")[1].splitlines() if line.split()[:1] == [name])
        assert line.split()[1:4] == [f"{saved['metrics'][name]:.4f}", f"{against['metrics'][name]:.4f}",
                                     f"{difference:+.4f}"]
    assert f"against {earlier}, on the same 60 texts" in printed
    # a model against itself: every difference 0, with no width, and the texts are said to show nothing
    assert main([str(out), "--file", str(data), "--against", str(out), "--json", str(report)]) == 0
    itself = json.loads(report.read_text())["against"]
    assert set(itself["differences"].values()) == {0.0}
    assert all(interval == [0.0, 0.0] for interval in itself["intervals"].values())
    assert "the interval holds 0, so these texts are no evidence that either model is better" in capsys.readouterr().out
    # a folder with no model: one line naming the option, before the first model is scored
    assert main([str(out), "--file", str(data), "--against", str(tmp_path / "nothere")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: --against {tmp_path / 'nothere'}: no model here") and not captured.out


def test_a_model_that_answers_another_question_is_not_compared():
    import numpy as np

    from finetune.comparison import compare
    from finetune.errors import ConfigError
    from finetune.metrics import MetricSuite
    from finetune.tasks import Task

    class Scored:  # a Score of a single-label model on two texts
        labels, confusion, by_label, texts, pairs = ["ham", "spam"], np.zeros((2, 2)), {}, ["a", "b"], None
        predictions, references, metrics, scores = np.array([0, 1]), np.array([0, 1]), {"accuracy": 1.0}, None

    class Other:
        labels, problem_type = ["ham", "eggs"], "single_label"

        @property
        def task(self):
            return Task(self.problem_type)

        def logits(self, texts, pairs, progress):
            return np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)

    suite = MetricSuite(["accuracy"], 2)
    with pytest.raises(ConfigError, match=r"^--against other: its model predicts 'eggs', which is no label of this "
                                          r"run's \(ham, spam\)"):
        compare(Scored(), Other(), "other", suite)
    Other.labels, Other.problem_type = ["spam", "ham"], "multi_label"
    with pytest.raises(ConfigError, match=r"^--against other: its model is multi_label, this run's single_label: "
                                          r"the two do not answer the same question"):
        compare(Scored(), Other(), "other", suite)
    Other.problem_type = "single_label"  # the same labels in another order: matched by name
    assert compare(Scored(), Other(), "other", suite).metrics == {"accuracy": 0.0}


def test_label_sets_and_numbers_are_compared_in_this_runs_terms():
    import numpy as np

    from finetune.comparison import in_this_runs_labels

    # the other model's columns (spam, news) are this run's (news, sport, spam) moved; sport it never predicts
    moved = in_this_runs_labels(np.array([[1, 0], [1, 1]]), ["spam", "news"], ["news", "sport", "spam"],
                                "multi_label")
    assert moved.tolist() == [[0, 0, 1], [1, 0, 1]]
    assert in_this_runs_labels(np.array([2, 0]), ["b", "c", "a"], ["a", "b", "c"], "single_label").tolist() == [0, 1]
    numbers = np.array([0.5, 2.0])
    assert in_this_runs_labels(numbers, [], [], "regression") is numbers


def test_score_adds_a_files_scores_to_the_card_as_the_hub_reads_them(trained, tmp_path, capsys):
    """``--card``: the scores on the file become a result of the card's model-index, which the Hub's own parser reads
    back to the numbers score wrote, beside the validation data's; a file scored again replaces its own."""
    import shutil

    from huggingface_hub import ModelCard

    from finetune.model_card import SCORED_SPLIT
    from finetune.score import main as score

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    held_out = write_tsv(tmp_path / "held_out.tsv", make_texts(12, seed=4))
    before = ModelCard.load(out / "README.md").data.eval_results
    assert score([str(out), "--file", str(held_out), "--card", "--json", str(tmp_path / "s.json")]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"model card: {out / 'README.md'}")
    scored = json.loads((tmp_path / "s.json").read_text())
    results = ModelCard.load(out / "README.md").data.eval_results
    assert results[:len(before)] == before
    assert {(r.dataset_name, r.dataset_split, r.metric_type): r.metric_value for r in results[len(before):]} == {
        ("held_out.tsv", SCORED_SPLIT, metric): value for metric, value in scored["metrics"].items()
        if metric != "num_samples"}
    card = (out / "README.md").read_text()
    low, high = scored["intervals"]["accuracy"]
    assert f"| Accuracy | {scored['metrics']['accuracy']:.4f} | {low:.4f} to {high:.4f} |" in card
    assert card.index("## Results on held_out.tsv, scored after training (12 texts)") < card.index("\n## Use\n")
    assert score([str(out), "--file", str(held_out), "--card", "evaluation.metrics=[accuracy]"]) == 0
    again = ModelCard.load(out / "README.md").data.eval_results
    assert again[:len(before)] == before
    assert [(r.dataset_name, r.metric_type) for r in again[len(before):]] == [("held_out.tsv", "loss"),
                                                                             ("held_out.tsv", "accuracy")]
    assert (out / "README.md").read_text().count("## Results on held_out.tsv") == 1


def test_the_same_run_again_keeps_the_files_score_added_to_its_card_and_a_new_run_does_not(trained, tmp_path):
    """A finished run's command run again resumes it at its end and writes its outputs again: the card keeps the
    file `finetune score --card` scored, whose scores are this model's. A new run in the folder (output.overwrite)
    is another model, whose card has no such scores."""
    import shutil

    from finetune import fit, load_config, setup_run
    from finetune.score import main as score
    from tiny_run import tiny_process

    def train_again(*overrides: str) -> str:
        with tiny_process():
            fit(setup_run(load_config(str(out / "config.yaml"), [f"output.output_dir={out}", *overrides])))
        return (out / "README.md").read_text()

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    unscored = train_again()  # the card as a run in this folder writes it
    held_out = write_tsv(tmp_path / "held_out.tsv", make_texts(12, seed=4))
    assert score([str(out), "--file", str(held_out), "--card"]) == 0
    scored = (out / "README.md").read_text()
    assert scored != unscored and "<!-- finetune score: held_out.tsv -->" in scored
    assert train_again() == scored
    fresh = train_again("output.overwrite=true", "training.seed=5")
    assert "held_out.tsv" not in fresh and "## Results on the validation data" in fresh


def test_score_adds_to_no_card_but_one_a_run_wrote_and_only_at_the_models_thresholds(trained, tmp_path, capsys):
    import shutil

    from finetune.score import main as score

    out = tmp_path / "run"
    # the run without the pictures earlier tests' scorings drew into it: the absence of one is checked below
    shutil.copytree(trained[0], out, ignore=shutil.ignore_patterns("confusion_*.png"))
    held_out = write_tsv(tmp_path / "held_out.tsv", make_texts(12, seed=4))
    card = (out / "README.md").read_text()
    assert score([str(out), "--file", str(held_out), "--card", "evaluation.threshold=0.3"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --card: the card holds the model's results at its own "
                                               "thresholds, which evaluation.threshold replaces; give one of the two")
    assert (out / "README.md").read_text() == card
    (out / "README.md").write_text("# my notes\n")  # a README of the user's
    assert score([str(out), "--file", str(held_out), "--card"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --card: {out / 'README.md'} is not a model card a finetune run wrote; score the run's own folder "
        "(a checkpoint has no card), or leave out --card")
    assert (out / "README.md").read_text() == "# my notes\n"
    assert not (out / "confusion_held_out.png").exists()  # refused before anything was scored
    checkpoint = next((out / "checkpoints").iterdir())
    assert score([str(checkpoint), "--file", str(held_out), "--card"]) == 2
    assert "is not a model card a finetune run wrote" in capsys.readouterr().err
