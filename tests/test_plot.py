"""curves.png: written by fit and by ``python -m finetune.plot``, with the run's numbers in it."""

from __future__ import annotations

import json
import struct
import sys

import pytest

import forked
from helpers import offline_env
from tiny_run import fit_tiny_run

pytest.importorskip("matplotlib")

from finetune.plot import (CURVES_SIZE, DPI, compare_figure, curves_figure, epoch_boundaries, main,  # noqa: E402
                           smooth)

EXPECTED_PIXELS = (int(CURVES_SIZE[0] * DPI), int(CURVES_SIZE[1] * DPI))


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def synthetic_records(epochs: int = 2, per_epoch: int = 5) -> list[dict]:
    records, step = [], 0
    for epoch in range(epochs):
        for j in range(1, per_epoch + 1):
            step += 1
            records.append({"step": step, "epoch": epoch + j / per_epoch, "train/loss": 1.0 / step + 0.1 * (step % 2),
                            "train/lr": 1e-4 * (1 - step / (epochs * per_epoch))})
        records.append({"step": step, "epoch": epoch + 1, "eval/loss": 0.5 / (epoch + 1), "eval/num_samples": 40,
                        "eval/accuracy": 0.7 + 0.1 * epoch, "eval/f1": 0.5 + 0.2 * epoch})
    return records


def test_smooth():
    assert smooth([2.0] * 7) == pytest.approx([2.0] * 7)
    noisy = [1.0 + (0.5 if i % 2 else -0.5) for i in range(40)]
    smoothed = smooth(noisy, span=9)
    assert smoothed[0] == noisy[0]  # debiased: no pull towards 0 at the start
    assert max(abs(v - 1.0) for v in smoothed[10:]) < 0.15
    assert smooth(noisy, span=1) == pytest.approx(noisy)
    assert smooth([1.0, float("nan"), 3.0], span=1) == pytest.approx([1.0, 1.0, 3.0])


def test_figure_holds_the_records():
    records = synthetic_records()
    train = [r for r in records if "train/loss" in r]
    assert epoch_boundaries(train) == [(5, 1), (10, 2)]
    fig = curves_figure(records)
    ax_loss, ax_lr, ax_eval = fig.axes
    raw, smoothed, val = ax_loss.lines[:3]
    assert list(raw.get_xdata()) == list(range(1, 11))
    assert list(raw.get_ydata()) == pytest.approx([r["train/loss"] for r in train])
    assert list(smoothed.get_ydata()) == pytest.approx(smooth([r["train/loss"] for r in train]))
    assert list(val.get_xdata()) == [5, 10] and list(val.get_ydata()) == pytest.approx([0.5, 0.25])
    assert list(ax_lr.lines[0].get_ydata()) == pytest.approx([r["train/lr"] for r in train])
    assert {line.get_label(): list(line.get_ydata()) for line in ax_eval.lines if not line.get_label().startswith("_")
            } == {"accuracy (0.800)": pytest.approx([0.7, 0.8]), "f1 (0.700)": pytest.approx([0.5, 0.7])}
    for ax in fig.axes:  # the epoch boundaries are marked on every panel
        marks = [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"]
        assert marks == [5, 10]


def test_each_evaluation_shows_its_interval_as_a_bar_of_its_metrics_colour():
    records = synthetic_records()
    evals = [r for r in records if "eval/loss" in r]
    evals[0]["eval_intervals"] = {"accuracy": [0.6, 0.8], "f1": [0.3, 0.65]}
    evals[1]["eval_intervals"] = {"accuracy": [0.7, 0.9]}  # f1 recorded without one
    ax_eval = curves_figure(records).axes[2]
    lines = {line.get_label().split()[0]: line for line in ax_eval.lines if not line.get_label().startswith("_")}
    bars = {}
    for collection in ax_eval.collections:
        (colour,) = collection.get_colors()  # one metric's bars, in one colour
        bars[tuple(colour[:3])] = [[tuple(point) for point in segment] for segment in collection.get_segments()]
    from matplotlib.colors import to_rgb

    # at each evaluation's update, each metric's a little apart (a hundredth of the run's updates at most)
    accuracy, f1 = bars[to_rgb(lines["accuracy"].get_color())], bars[to_rgb(lines["f1"].get_color())]
    assert [[y for _, y in bar] for bar in accuracy] == [[0.6, 0.8], [0.7, 0.9]]
    assert [[y for _, y in bar] for bar in f1] == [[0.3, 0.65]]
    assert [bar[0][0] for bar in accuracy] == pytest.approx([5, 10], abs=0.1) and accuracy[0][0][0] != f1[0][0][0]
    assert ax_eval.get_legend().get_title().get_text() == "bars: 95% intervals"
    assert curves_figure(synthetic_records()).axes[2].get_legend().get_title().get_text() == ""  # none recorded


def test_fit_writes_curves_png_and_the_cli_redraws_it(tmp_path):
    _, summary = fit_tiny_run(tmp_path)
    out = tmp_path / "out"
    assert png_size(out / "curves.png") == EXPECTED_PIXELS
    assert summary["train"]["updates"] > 0
    target = tmp_path / "again.png"
    proc = forked.run([sys.executable, "-m", "finetune.plot", str(out), "--output", str(target)], env=offline_env(),
                      timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target)
    assert png_size(target) == EXPECTED_PIXELS


def test_cli_without_a_log_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path}: no train_log.jsonl here (is it the output_dir of a run?)"]
    (tmp_path / "train_log.jsonl").write_text(json.dumps({"step": 1, "epoch": 1, "eval/loss": 0.3}) + "\n")
    assert main([str(tmp_path)]) == 2
    assert "no training records" in capsys.readouterr().err
    assert not (tmp_path / "curves.png").exists()


def test_an_output_that_is_no_picture_or_a_file_of_the_run_is_one_line(tmp_path, capsys):
    (tmp_path / "train_log.jsonl").write_text(json.dumps({"step": 1, "epoch": 1, "train/loss": 0.3}) + "\n")
    (tmp_path / "config.yaml").write_text("training: {}\n")
    for name, message in (("config.yaml", f"--output {tmp_path / 'config.yaml'}: is a file of the run in {tmp_path}; "
                                          "name another file"),
                          ("curves.yaml", f"{tmp_path / 'curves.yaml'}: not a picture format matplotlib writes "
                                          "(.png, .pdf, .svg, ...)")):
        assert main([str(tmp_path), "--output", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert (tmp_path / "config.yaml").read_text() == "training: {}\n" and not (tmp_path / "curves.yaml").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "train_log.jsonl"]
    # a directory: refused in one line, where the drawing's temporary file was left beside it and the replace failed
    (tmp_path / "pictures").mkdir()
    assert main([str(tmp_path), "--output", str(tmp_path / "pictures")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --output {tmp_path / 'pictures'}: is a "
                                                            f"directory; name a file"]
    (tmp_path / "pictures").rmdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "train_log.jsonl"]
    # the run's own curves.png is what plot redraws; another format is written as its suffix says
    assert main([str(tmp_path)]) == 0 and main([str(tmp_path), "--output", str(tmp_path / "curves.svg")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert b"<svg" in (tmp_path / "curves.svg").read_bytes()[:500]


def _samples(records: list[dict], batch: int) -> list[dict]:
    """The records as a run of ``batch`` samples an update logs them (``train/samples`` so far)."""
    return [{**r, "train/samples": r["step"] * batch} if "train/loss" in r else r for r in records]


def test_several_runs_are_compared_over_the_samples_seen_one_colour_each(tmp_path):
    """A run of 16 samples an update beside one of 8 that makes twice the updates of the same samples: over the
    samples seen, their curves cover the same span."""
    small, large = _samples(synthetic_records(per_epoch=10), 8), _samples(synthetic_records(per_epoch=5), 16)
    fig = compare_figure({"outputs/b8": small, "outputs/b16": large})
    ax_loss, ax_lr, ax_eval = fig.axes
    for name, records in (("outputs/b8", small), ("outputs/b16", large)):
        train = [r for r in records if "train/loss" in r]
        samples = [r["train/samples"] for r in train]
        (loss,) = [line for line in ax_loss.lines if line.get_label() == name]
        assert list(loss.get_xdata()) == samples
        assert list(loss.get_ydata()) == pytest.approx(smooth([r["train/loss"] for r in train]))
        (lr,) = [line for line in ax_lr.lines if line.get_label() == name]
        assert list(lr.get_ydata()) == pytest.approx([r["train/lr"] for r in train])
        assert lr.get_color() == loss.get_color()
        evals = [r for r in records if "eval/accuracy" in r]  # the first metric both have, besides the loss
        (accuracy,) = [line for line in ax_eval.lines if line.get_label().startswith(f"{name} (")]
        assert list(accuracy.get_ydata()) == [r["eval/accuracy"] for r in evals]
        assert list(accuracy.get_xdata()) == [r["step"] * (160 // len(train)) for r in evals]
        assert accuracy.get_label() == f"{name} ({evals[-1]['eval/accuracy']:.3f})"
    assert max(ax_loss.lines[0].get_xdata()) == max(ax_loss.lines[1].get_xdata()) == 160
    assert ax_eval.get_title() == "validation accuracy" and ax_loss.get_xlabel() == "training samples seen"
    f1 = compare_figure({"a": small, "b": large}, metric="f1").axes[2]
    assert [list(line.get_ydata()) for line in f1.lines] == [[r["eval/f1"] for r in run if "eval/f1" in r]
                                                             for run in (small, large)]


def test_the_cli_compares_runs_into_one_picture_and_says_what_is_missing_in_one_line(tmp_path, capsys):
    runs = []
    for name, batch in (("b8", 8), ("b16", 16)):
        runs.append(tmp_path / name)
        runs[-1].mkdir()
        records = _samples(synthetic_records(), batch)
        (runs[-1] / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dirs = [str(run) for run in runs]
    assert main([*dirs, "--output", str(tmp_path / "compared.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "compared.png")
    assert png_size(tmp_path / "compared.png") == EXPECTED_PIXELS
    assert main(dirs) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: 2 runs: --output names the picture of their curves side by side",
        f"hint: finetune plot {' '.join(dirs)} --output compared.png"]
    assert main([*dirs, "--output", str(tmp_path / "x.png"), "--metric", "matthews"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {runs[0]}: no validation 'matthews' (its evaluations have accuracy, f1, loss)"]
    assert main([dirs[0], "--metric", "f1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --metric: for several runs; one run's curves show every metric"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b16", "b8", "compared.png"]


@pytest.mark.parametrize("k", [5, 26, 150])
def test_a_confusion_matrix_writes_its_counts_where_a_cell_holds_them(k):
    import numpy as np

    from finetune.plot import COUNTS_WRITTEN_UP_TO, confusion_figure

    matrix = np.random.default_rng(k).integers(0, 5, (k, k)) + np.diag(np.full(k, 30))
    ax = confusion_figure(matrix, [f"intent_{i}" for i in range(k)]).axes[0]
    written = [text.get_text() for text in ax.texts]
    if k <= COUNTS_WRITTEN_UP_TO:
        assert written == [str(int(v)) for v in matrix.ravel()]  # row by row, each cell its count
    else:  # too small a cell for a count: the colours, and finetune score's list of the pairs most confused
        assert written == []
    assert [tick.get_text() for tick in ax.get_yticklabels()] == [f"intent_{i}" for i in range(k)]
    assert ax.get_yticklabels()[0].get_fontsize() == min(10.0, max(3.0, 480.0 / k))
