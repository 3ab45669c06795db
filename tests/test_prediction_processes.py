"""``finetune predict``, ``finetune score`` and a :class:`~finetune.predict.Predictor` under ``accelerate launch``:
every process runs a share of the batches one process would run, each gets the rows back, and the first reports
what one process reports, once (two processes over gloo on the CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import forked
from helpers import REPO, free_port, make_texts, offline_env, write_tsv
from tiny_run import fit_tiny_run, tiny_process

# one thread in every process, so that one process and two compute alike
ENV = {"CUDA_VISIBLE_DEVICES": "", "FINETUNE_CPU_THREADS": "1"}
TEXTS = ["free cash prize call now", "see you at dinner tonight", "win",
         "hello ok thanks love you see you later at home tonight good night",
         "urgent claim your offer txt now free free", "sorry late for the meeting", "txt WIN to 80082 for a prize"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    cfg, _ = fit_tiny_run(root)
    return Path(cfg.output.output_dir)


def _alone(*args: str) -> forked.subprocess.CompletedProcess:
    return forked.run([sys.executable, *args], env=offline_env(ENV), timeout=300)


def _launched(*args: str) -> forked.subprocess.CompletedProcess:
    """``accelerate launch`` of two processes, on a free port."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                "--dynamo_backend", "no"]
    return forked.run(launcher + list(args), env=offline_env(ENV), timeout=300)


@pytest.mark.slow
def test_a_predictor_shares_its_batches_among_the_processes_launched(trained, tmp_path):
    """Seven texts in batches of two: the first process runs the first and third batches, the second the others,
    and both get back every text's logits, those of one process bit for bit. Each tokenizes its half of the texts
    for their lengths, then the texts of its batches alone."""
    from finetune.predict import Predictor
    from finetune.shares import batches_of_share

    done = _launched(str(REPO / "tests" / "prediction_worker.py"), str(tmp_path), str(trained), json.dumps(TEXTS))
    assert done.returncode == 0, done.stderr[-3000:]
    processes = [json.loads((tmp_path / f"process{index}.json").read_text()) for index in (0, 1)]
    with tiny_process():
        alone = Predictor.load(trained, batch_size=2)
        expected = alone.logits(TEXTS)
    assert alone.processes == (0, 1)
    assert [p["processes"] for p in processes] == [[0, 2], [1, 2]]
    assert [p["batches"] for p in processes] == [[2, 2], [2, 1]]
    for process in processes:
        assert np.array_equal(np.asarray(process["logits"], dtype=np.float32), expected)
    _, lengths = alone.features_of(TEXTS, None, range(len(TEXTS)))
    for index, half in [(0, TEXTS[:3]), (1, TEXTS[3:])]:
        batches = batches_of_share(lengths, 2, (index, 2))
        assert sorted(processes[index]["tokenized"]) == sorted(half + [TEXTS[row] for row in sum(batches, [])])


@pytest.mark.slow
def test_finetune_predict_under_a_launch_writes_and_prints_what_one_process_does_once(trained, tmp_path):
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    # in batches of two, which the two processes share
    command = ["-m", "finetune.predict", str(trained), "--file", str(lines), "--batch-size", "2"]
    alone, shared = _alone(*command, "--output", str(one)), _launched(*command, "--output", str(two))
    assert alone.returncode == 0 and shared.returncode == 0, shared.stderr[-3000:]
    assert two.read_bytes() == one.read_bytes()

    alone = _alone("-m", "finetune.predict", str(trained), *TEXTS, "--batch-size", "2")
    shared = _launched("-m", "finetune.predict", str(trained), *TEXTS, "--batch-size", "2")
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert len(alone.stdout.splitlines()) == len(TEXTS) and shared.stdout == alone.stdout  # once, not per process

    refused = _launched("-m", "finetune.predict", str(trained), "--file", "-")
    assert refused.returncode != 0
    assert ("error: --file -: standard input cannot be shared by the processes launched; give a file"
            in refused.stderr), refused.stderr[-3000:]


@pytest.mark.slow
def test_finetune_score_under_a_launch_reports_once_what_one_process_reports(trained, tmp_path):
    held_out = write_tsv(tmp_path / "held_out.tsv", make_texts(9, seed=5))
    picture, scores = tmp_path / "confusion.png", tmp_path / "scores.json"
    command = ["-m", "finetune.score", str(trained), "--file", str(held_out), "--png", str(picture),
               "--json", str(scores), "--against", str(trained), "--batch-size", "2"]
    alone = _alone(*command)
    assert alone.returncode == 0, alone.stderr[-3000:]
    expected = json.loads(scores.read_text())
    scores.unlink()
    shared = _launched(*command)
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert shared.stdout == alone.stdout  # the scores, the labels' table, the matrix and the comparison, once
    # one progress bar a model, the first process's, of its share: batches of 2, 2 and 1 of the 9 texts (the
    # other process ran 2 and 2)
    assert shared.stderr.count("| 5/5 [") == 2 and "/4 [" not in shared.stderr, shared.stderr[-3000:]
    assert json.loads(scores.read_text()) == expected
    assert expected["metrics"]["num_samples"] == 9 and expected["against"] is not None


@pytest.mark.slow
def test_a_folder_of_runs_predicts_under_a_launch_as_one_process_does(trained, tmp_path):
    """An ensemble's processes share each model's batches in turn: the file one process writes, and its note
    once."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "folds"
    for name in ("fold-1", "fold-2"):
        shutil.copytree(trained, folder / name, ignore=shutil.ignore_patterns("checkpoints", ".finetune.lock"))
    weights = load_file(folder / "fold-2" / "model.safetensors")
    weights["classifier.weight"] = 0.25 * weights["classifier.weight"]  # another model: less sure of every text
    save_file(weights, folder / "fold-2" / "model.safetensors", metadata={"format": "pt"})
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    command = ["-m", "finetune.predict", str(folder), "--file", str(lines), "--batch-size", "2"]
    alone, shared = _alone(*command, "--output", str(one)), _launched(*command, "--output", str(two))
    assert alone.returncode == 0 and shared.returncode == 0, shared.stderr[-3000:]
    assert two.read_bytes() == one.read_bytes()
    assert shared.stderr.count("2 models, their probabilities averaged") == 1, shared.stderr[-3000:]
    single = tmp_path / "single.csv"
    assert _alone("-m", "finetune.predict", str(trained), "--file", str(lines), "--output", str(single)).returncode == 0
    assert one.read_bytes() != single.read_bytes()  # the second model moved the averages
