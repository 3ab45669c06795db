"""Training curves and confusion matrices as PNG files.

``finetune plot <output_dir>`` (or ``python -m finetune.plot``) reads ``<output_dir>/train_log.jsonl``
and writes ``<output_dir>/curves.png`` (``fit`` does the same at the end of
training):

* loss per update, with a smoothed line and the validation loss at each evaluation;
* learning rate per update;
* validation metrics at each evaluation;

with the updates at epoch boundaries marked on all three. ``finetune plot DIR DIR ... --output FILE`` draws
several runs' curves side by side instead (:func:`compare_figure`).

The figures are built with ``matplotlib.figure.Figure`` rather than
``pyplot``, so a training process keeps no global figure state and needs no
display. In a notebook, ``display(fig)`` (or leaving ``fig`` as the cell's last
value) shows them inline.
"""

from __future__ import annotations

import bisect
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from finetune.errors import CommandParser, DataError, FinetuneError, run_command
from finetune.outputs import CURVES_FILE, LOG_FILE, refuse_a_run_file

# Figure size in inches and resolution: curves.png is 1500 x 420 pixels.
CURVES_SIZE = (15.0, 4.2)
DPI = 100


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise FinetuneError("plotting needs matplotlib, which is not installed (pip install matplotlib)") from None
    return Figure


def picture_format(path: Path, flag: Optional[str] = None) -> str:
    """The format matplotlib is to write ``path`` in: its extension's, PNG where it has none (passed to
    ``savefig`` as such, so that the file is the name given, not the name plus ``.png``).

    Raises:
        DataError: for an extension matplotlib writes no picture for, naming ``flag`` where given.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    kind = path.suffix.lstrip(".").lower() or "png"
    if kind not in FigureCanvasBase.get_supported_filetypes():
        where = f"{flag} {path}" if flag else str(path)
        raise DataError(f"{where}: not a picture format matplotlib writes (.png, .pdf, .svg, ...)")
    return kind


def smooth(values: Sequence[float], span: Optional[int] = None) -> list[float]:
    """Exponential moving average, debiased at the start (as TensorBoard's smoothing).

    Args:
        values: The series, in update order.
        span: Averaging span in points (pandas' ``span``: weight ``1 - 2/(span+1)``
            on the running mean); by default a tenth of the series, between 1 and 50.

    Returns:
        The smoothed series, same length. Non-finite values are skipped (the
        running mean carries over them).
    """
    n = len(values)
    if span is None:
        span = min(50, max(1, n // 10))
    weight = 1.0 - 2.0 / (span + 1)
    out, mean, norm = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            mean = weight * mean + (1.0 - weight) * value
            norm = weight * norm + (1.0 - weight)
        out.append(mean / norm if norm > 0 else float("nan"))
    return out


def _number(value: Any) -> Optional[float]:
    # train_log.jsonl stores NaN/inf as strings; anything else non-numeric is not a curve value
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def split_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training records (with ``train/loss``) and evaluation records (with ``eval/...``), by step."""
    train = sorted((r for r in records if "train/loss" in r), key=lambda r: r["step"])
    evals = sorted((r for r in records if any(k.startswith("eval/") for k in r)), key=lambda r: r.get("step", 0))
    return train, evals


def epoch_boundaries(train: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(update, epoch)`` for each training record that ends an epoch (its ``epoch`` is whole)."""
    marks = []
    for r in train:
        epoch = _number(r.get("epoch"))
        if epoch is not None and epoch > 0 and abs(epoch - round(epoch)) < 1e-9:
            marks.append((int(r["step"]), round(epoch)))
    return marks


def _mark_epochs(ax, marks: list[tuple[int, int]], label: bool = False) -> None:
    for step, epoch in marks:
        ax.axvline(step, color="0.6", linestyle="--", linewidth=0.8, zorder=0)
        if label:
            ax.annotate(f"epoch {epoch}", xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(-2, -2),
                        textcoords="offset points", ha="right", va="top", fontsize=8, color="0.4")


def curves_figure(records: list[dict[str, Any]], title: Optional[str] = None):
    """The three-panel figure of a run's records (loss, learning rate, validation metrics).

    Args:
        records: Records as in ``train_log.jsonl`` (see :func:`finetune.tracking.read_log`),
            or the dicts ``train_one_epoch`` hands to ``on_log`` plus evaluation
            records ``{"step": ..., "epoch": ..., "eval/<name>": ...}``.
        title: Figure title.

    Returns:
        A ``matplotlib.figure.Figure`` of :data:`CURVES_SIZE` inches at :data:`DPI`.

    Raises:
        DataError: if there is no training record to plot.
    """
    Figure = _matplotlib()
    train, evals = split_records(records)
    if not train:
        raise DataError("no training records (train/loss) to plot")
    steps = [int(r["step"]) for r in train]
    loss = [_number(r["train/loss"]) for r in train]
    loss = [v if v is not None else float("nan") for v in loss]
    marks = epoch_boundaries(train)

    fig = Figure(figsize=CURVES_SIZE, dpi=DPI, layout="constrained")
    ax_loss, ax_lr, ax_eval = fig.subplots(1, 3, sharex=True)

    per = "update" if all(b - a == 1 for a, b in zip(steps, steps[1:])) else "logged record"
    ax_loss.plot(steps, loss, color="tab:blue", alpha=0.35, linewidth=1, label=f"train loss (per {per})")
    ax_loss.plot(steps, smooth(loss), color="tab:blue", linewidth=2, label="smoothed")
    eval_loss = [(int(r["step"]), _number(r.get("eval/loss"))) for r in evals if "eval/loss" in r]
    if eval_loss:
        ax_loss.plot([s for s, _ in eval_loss], [v for _, v in eval_loss], "o-", color="tab:orange",
                     label="validation loss")
    ax_loss.set_title("loss")
    ax_loss.set_xlabel("update")
    ax_loss.legend(fontsize=8)

    if any("train/lr" in r for r in train):
        ax_lr.plot(steps, [_number(r.get("train/lr")) for r in train], color="tab:green")
    ax_lr.set_title("learning rate")
    ax_lr.set_xlabel("update")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    _plot_validation(ax_eval, evals, last_step=max(steps))

    for ax in (ax_loss, ax_lr, ax_eval):
        _mark_epochs(ax, marks, label=ax is ax_loss)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def metric_keys(evals: list[dict[str, Any]]) -> list[str]:
    """The ``eval/<metric>`` keys of evaluation records, in the order they first appear; the loss and the sample
    count left out."""
    return [k for k in dict.fromkeys(k for r in evals for k in r)
            if k.startswith("eval/") and k not in ("eval/loss", "eval/num_samples")]


def _plot_validation(ax, evals: list[dict[str, Any]], last_step: int) -> None:
    """The validation panel: each metric's points over the updates, and each evaluation's 95% bootstrap interval
    as a bar where the run recorded one (how far the point could move)."""
    names = metric_keys(evals)
    for i, name in enumerate(names):
        metric = name.removeprefix("eval/")
        points = [(int(r["step"]), _number(r[name])) for r in evals if name in r and _number(r[name]) is not None]
        # the last value goes in the legend: written next to the points, close metrics would overlap
        line, = ax.plot([s for s, _ in points], [v for _, v in points], "o-", label=f"{metric} ({points[-1][1]:.3f})")
        bars = [(int(r["step"]), *r["eval_intervals"][metric]) for r in evals
                if metric in (r.get("eval_intervals") or {})]
        if bars:  # each metric's bars a little apart, so that those of one evaluation do not hide each other
            apart = (i - (len(names) - 1) / 2) * 0.008 * last_step
            ax.vlines([s + apart for s, _, _ in bars], [low for _, low, _ in bars], [high for _, _, high in bars],
                      color=line.get_color(), alpha=0.5, linewidth=3)
    if names:
        shown = any(r.get("eval_intervals") for r in evals)
        ax.legend(fontsize=8, title="bars: 95% intervals" if shown else None, title_fontsize=8)
    else:
        ax.text(0.5, 0.5, "no validation records", ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax.set_title("validation metrics")
    ax.set_xlabel("update")


def compare_figure(runs: dict[str, list[dict[str, Any]]], metric: Optional[str] = None):
    """Several runs' curves in one figure, one colour per run: the smoothed training loss, the learning rate and
    one validation metric, over the training samples seen (runs of other effective batches make other numbers of
    updates of the same samples).

    Args:
        runs: Each run's records (as in ``train_log.jsonl``), by the name its lines are labelled with.
        metric: The validation metric to draw (``accuracy``, ``f1``, ``loss``, ...); by default the first that
            every run evaluated, besides the loss (the loss where there is none).

    Raises:
        DataError: for a run without training records, or a metric a run did not evaluate (naming the run and
            the metrics it has).
    """
    Figure = _matplotlib()
    split = {name: split_records(records) for name, records in runs.items()}
    for name, (train, _) in split.items():
        if not train:
            raise DataError(f"{name}: no training records (train/loss) to plot")
    metric = metric or shared_metric([evals for _, evals in split.values()])
    by_samples = all("train/samples" in r for train, _ in split.values() for r in train)
    fig = Figure(figsize=CURVES_SIZE, dpi=DPI, layout="constrained")
    ax_loss, ax_lr, ax_eval = fig.subplots(1, 3, sharex=True)
    for name, (train, evals) in split.items():
        steps = [int(r["step"]) for r in train]
        x = [_number(r["train/samples"]) for r in train] if by_samples else steps
        # an evaluation sits where the last training record at or before its update does (log_every > 1 leaves
        # some updates without one)
        at = lambda step: x[max(0, bisect.bisect_right(steps, step) - 1)]  # noqa: E731
        points = [(at(int(r["step"])), _number(r[f"eval/{metric}"])) for r in evals if f"eval/{metric}" in r]
        if evals and not points:
            have = sorted({k.removeprefix("eval/") for r in evals for k in r if k.startswith("eval/")} -
                          {"num_samples"})
            raise DataError(f"{name}: no validation {metric!r} (its evaluations have {', '.join(have)})")
        loss = [_number(r["train/loss"]) for r in train]
        line, = ax_loss.plot(x, smooth([v if v is not None else float("nan") for v in loss]), linewidth=2,
                             label=name)
        ax_lr.plot(x, [_number(r.get("train/lr")) for r in train], color=line.get_color(), label=name)
        if points:
            ax_eval.plot([s for s, _ in points], [v for _, v in points], "o-", color=line.get_color(),
                         label=f"{name} ({points[-1][1]:.3f})")
    for ax, title in ((ax_loss, "training loss (smoothed)"), (ax_lr, "learning rate"),
                      (ax_eval, f"validation {metric}")):
        ax.set_title(title)
        ax.set_xlabel("training samples seen" if by_samples else "update")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return fig


def shared_metric(evals_by_run: list[list[dict[str, Any]]]) -> str:
    """The first validation metric every run that evaluated has, besides the loss; ``loss`` where there is none."""
    named = [[k.removeprefix("eval/") for k in metric_keys(evals)] for evals in evals_by_run if evals]
    shared = [name for name in (named[0] if named else []) if all(name in other for other in named)]
    return shared[0] if shared else "loss"


def plot_curves(output_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Write the curves of the run in ``output_dir`` to ``path`` (default ``<output_dir>/curves.png``).

    Raises:
        DataError: if ``output_dir`` has no ``train_log.jsonl`` or the log has no training record.
    """
    output_dir = Path(output_dir)
    records = _run_records(output_dir)
    path = Path(path) if path is not None else output_dir / CURVES_FILE
    kind = _check_output(path, [output_dir] if path.resolve() != (output_dir / CURVES_FILE).resolve() else [])
    try:
        fig = curves_figure(records, title=str(output_dir))
    except DataError as exc:
        raise DataError(f"{output_dir / LOG_FILE}: {exc.message}") from None
    return _save(fig, path, kind)


def plot_comparison(output_dirs: Sequence[str | os.PathLike], path: str | os.PathLike,
                    metric: Optional[str] = None) -> Path:
    """Write the curves of the runs in ``output_dirs`` side by side (:func:`compare_figure`) to ``path``.

    Raises:
        DataError: as :func:`plot_curves` for each run, and as :func:`compare_figure`.
    """
    runs = {str(d): _run_records(Path(d)) for d in output_dirs}
    path = Path(path)
    kind = _check_output(path, [Path(d) for d in output_dirs])
    return _save(compare_figure(runs, metric), path, kind)


def _run_records(output_dir: Path) -> list[dict[str, Any]]:
    from finetune.tracking import read_log

    if not (output_dir / LOG_FILE).is_file():
        raise DataError(f"{output_dir}: no {LOG_FILE} here (is it the output_dir of a run?)")
    try:
        return read_log(output_dir)
    except ValueError as exc:  # json.JSONDecodeError
        raise DataError(f"{output_dir / LOG_FILE}: not JSON lines ({exc})") from None


def _check_output(path: Path, runs: list[Path]) -> str:
    """That a picture can be written at ``path``, and it is none of the files of ``runs``; returns its format."""
    if not path.resolve().parent.is_dir():
        raise DataError(f"{path}: its directory does not exist")
    for run in runs:
        refuse_a_run_file(path, run, "--output")
    return picture_format(path)


def _save(fig, path: Path, kind: str) -> Path:
    # through a temporary name: a stop while drawing leaves the old picture or the new one
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=DPI, format=kind)
    os.replace(tmp, path)
    return path


# past this many classes a cell is too small for its count: the colours and finetune score's printed list say it
COUNTS_WRITTEN_UP_TO = 25


def confusion_figure(matrix, names: Sequence[str], title: Optional[str] = None):
    """A confusion matrix as a heat map with the counts written in (rows: true, columns: predicted).

    Args:
        matrix: ``K x K`` counts, ``matrix[i][j]`` = samples of class ``i`` predicted as ``j``.
        names: The ``K`` class names.
        title: Figure title.
    """
    import numpy as np

    Figure = _matplotlib()
    m = np.asarray(matrix)
    k = len(names)
    side = min(12.0, 2.5 + 0.6 * k)
    fig = Figure(figsize=(side + 1.0, side), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    # colour by the share of each true class, so rare classes are as readable as common ones
    rows = m.sum(axis=1, keepdims=True)
    share = np.divide(m, rows, out=np.zeros(m.shape, dtype=float), where=rows > 0)
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, label="share of the true class")
    if k <= COUNTS_WRITTEN_UP_TO:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, str(int(m[i, j])), ha="center", va="center",
                        color="white" if share[i, j] > 0.5 else "black", fontsize=9)
    # the names shrink with their number to stay one per row of a figure that stops growing at 12 inches
    names_size = min(10.0, max(3.0, 480.0 / k))
    ax.set_xticks(range(k), labels=list(names), rotation=45 if k > 4 else 0, ha="right" if k > 4 else "center",
                  fontsize=names_size)
    ax.set_yticks(range(k), labels=list(names), fontsize=names_size)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if title:
        ax.set_title(title)
    return fig


def main(argv: list[str] | None = None) -> int:
    """``finetune plot <output_dir> [<output_dir> ...] [--output PATH] [--metric NAME]``; returns the exit code."""
    parser = CommandParser(prog="finetune plot",
                           description="Plot a run's loss, learning rate and validation metrics, or several runs' "
                                       "side by side.")
    parser.add_argument("output_dirs", nargs="+", metavar="output_dir",
                        help="a run's output directory (holds train_log.jsonl); several: their curves in one figure")
    parser.add_argument("--output", default=None, help=f"the picture to write (default, for one run: "
                        f"<output_dir>/{CURVES_FILE}; several need it)")
    parser.add_argument("--metric", default=None, help="several runs: the validation metric to compare (default: "
                        "the first every run evaluated, besides the loss)")
    args = parser.parse_args(argv)
    return run_command(lambda: print(_plot(args.output_dirs, args.output, args.metric)))


def _plot(output_dirs: list[str], output: Optional[str], metric: Optional[str]) -> Path:
    if len(output_dirs) == 1:
        if metric is not None:
            raise DataError("--metric: for several runs; one run's curves show every metric")
        return plot_curves(output_dirs[0], output)
    if output is None:
        raise DataError(f"{len(output_dirs)} runs: --output names the picture of their curves side by side",
                        hint=f"finetune plot {' '.join(output_dirs)} --output compared.png")
    return plot_comparison(output_dirs, output, metric)


if __name__ == "__main__":
    sys.exit(main())
