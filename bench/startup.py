"""How long a run takes to start on a large data set: everything before its first update, timed.

Usage::

    python -m bench.startup                                   # 300,000 rows, this checkout
    git worktree add /tmp/before <commit>
    python -m bench.startup --baseline /tmp/before            # that checkout and this one, side by side

Times ``finetune.assembly.setup_run`` (reading the file, carving the
validation set, tokenizing, the memory plan, building the loaders) on the
default config, its SMS file repeated to ``--rows`` rows (each copy numbered,
so that every text is distinct) and tokenized afresh
(``data.cache_tokenized=false``). A data set of that size is where the
package's own work shows beside tokenizing: a step that reads a column of
the data set one row at a time costs seconds per hundred thousand rows.

With ``--dry-run``, each way then makes ``finetune train --dry-run``'s
rehearsal (ten updates and the timing of an evaluation) and a real
evaluation: the rehearsal's seconds, its estimate of one evaluation, and the
evaluation's own seconds, which past 2,000 validation texts it estimates from
a sample.

With ``--data-error``, each way instead runs the command a user types,
``finetune train --data FILE --label sentiment``, on the file, which has no
such column: the seconds from the process's start to its one-line error,
which is what a user waits for each time a file of their own is wrong.

With ``--predict``, each way runs ``finetune predict MODEL "a text"`` (a small saved BERT with the embedded
MiniLM's tokenizer): the seconds from the process's start to the printed prediction, what a user waits for each
time they try the model on a sentence.

``--set KEY=VALUE`` (repeatable) overrides a setting of this checkout's runs, not the baseline's, which may
not have the setting: ``--set data.tokenize_processes=1`` times this checkout as one process tokenizes.
``--set-all KEY=VALUE`` overrides it in every way's runs: ``--set-all model.problem_type=multi_label --set-all
"data.label_delimiter=|"`` times a multi-label run's start (each message a set of one label).

Each way runs in a fresh process, the ways alternating by round, and
reports the median of its rounds. Prints a Markdown table for bench/README.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# run in a fresh interpreter, with the checkout to time first on the import path
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from finetune.assembly import setup_run
from finetune.config import load_config
cfg = load_config(sys.argv[2], sys.argv[3:])
began = time.perf_counter()
run = setup_run(cfg)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - began, "train_rows": len(run.train_dataloader.dataset)}))
"""

# the same start, then the dry run's rehearsal and a real evaluation, timed
DRY_RUN_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from finetune.assembly import setup_run
from finetune.config import load_config
from finetune.fitting import evaluate_run
from finetune.rehearsal import rehearse
run = setup_run(load_config(sys.argv[2], sys.argv[3:]))
began = time.perf_counter()
rehearsal = rehearse(run)
dry_run = time.perf_counter() - began
began = time.perf_counter()
evaluate_run(run)
print("RESULT " + json.dumps({"seconds": dry_run, "estimate": rehearsal.evaluation_seconds,
                              "evaluation": time.perf_counter() - began,
                              "validation_rows": len(run.eval_dataloader.dataset)}))
"""


def default_job_messages() -> list[tuple[str, str]]:
    """The default config's SMS messages as ``(label, text)``, read as a run reads them, none carved off."""
    from finetune.columns import read_column
    from finetune.config import load_config
    from finetune.data import LABELS, TEXT, load_splits
    from finetune.predict import quiet_progress_bars

    quiet_progress_bars()
    cfg = load_config(str(REPO / "configs" / "default.yaml"), ["data.validation_split=0"])
    splits, labels = load_splits(cfg.data, seed=cfg.training.seed)
    return list(zip([labels.names[i] for i in read_column(splits["train"], LABELS)],
                    read_column(splits["train"], TEXT)))


def write_rows(path: Path, rows: int) -> None:
    """The default config's SMS messages, repeated and numbered up to ``rows`` rows, as a TSV with a header."""
    messages = default_job_messages()
    with open(path, "w", encoding="utf-8", newline="") as f:
        out = csv.writer(f, delimiter="\t", lineterminator="\n")
        out.writerow(["label", "text"])
        for i in range(rows):
            label, text = messages[i % len(messages)]
            out.writerow([label, f"{text} ({i // len(messages)})"])


def time_setup(checkout: Path, data: Path, workdir: Path, dry_run: bool = False, settings: tuple = ()) -> dict:
    overrides = [f"data.train_file={data}", "data.cache_tokenized=false", "logging.progress_bar=false",
                 f"output.output_dir={workdir / 'out'}", "output.overwrite=true", *settings]
    return result_of([sys.executable, "-c", DRY_RUN_CHILD if dry_run else CHILD, str(checkout),
                      str(checkout / "configs" / "default.yaml"), *overrides],
                     f"{'the dry run' if dry_run else 'setup_run'} failed at {checkout}", cwd=workdir)


def result_of(command: list[str], failure: str, **options) -> dict:
    """What ``command`` (a fresh Python running one of these benchmarks' children) prints on its last ``RESULT``
    line, as JSON; where it prints none, or fails, a stop with ``failure`` and the end of its stderr.
    ``options``: :func:`subprocess.run`'s (``cwd``, ``env``)."""
    done = subprocess.run(command, capture_output=True, text=True, **options)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{failure}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def time_data_error(checkout: Path, data: Path, workdir: Path) -> dict:
    """``finetune train`` of ``checkout`` on ``data`` with a label column the file lacks, timed whole."""
    command = [sys.executable, "-m", "finetune.cli", "train", "--config", str(checkout / "configs" / "default.yaml"),
               "--data", str(data), "--label", "sentiment", "--output", str(workdir / "out")]
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    if done.returncode != 2 or not errors:
        raise SystemExit(f"the data error did not come at {checkout}:\n{done.stderr[-3000:]}")
    return {"seconds": seconds, "error": errors[-1].replace(str(data), data.name)}


def time_prediction(checkout: Path, model: Path, workdir: Path) -> dict:
    """``finetune predict`` of ``checkout`` on one text given on the command line, timed whole."""
    command = [sys.executable, "-m", "finetune.predict", str(model), "see you at lunch"]
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"finetune predict failed at {checkout}:\n{done.stderr[-3000:]}")
    return {"seconds": seconds, "label": json.loads(done.stdout.splitlines()[-1])["label"]}


def commit_of(checkout: Path) -> str:
    """The checkout's short commit, marked where its files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or str(checkout)
    return commit + (" with changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another checkout of the package (git worktree add ...)")
    parser.add_argument("--dry-run", action="store_true",
                        help="time the dry run's rehearsal and its estimate of an evaluation, not setup_run")
    parser.add_argument("--data-error", action="store_true",
                        help="time finetune train to its one-line error on a file without the label column named")
    parser.add_argument("--predict", action="store_true",
                        help="time finetune predict of one text given on the command line, to its printed answer")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of this checkout's runs (not the baseline's); repeatable")
    parser.add_argument("--set-all", dest="common", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every way's runs, the baseline's too; repeatable")
    args = parser.parse_args(argv)
    if (args.settings or args.common) and (args.data_error or args.predict):
        parser.error("--set and --set-all apply to setup_run and the dry run, not --data-error or --predict")
    # each way: its checkout and the settings its runs get
    ways = {f"this checkout, {commit_of(REPO)}" + (f" ({', '.join(args.settings)})" if args.settings else ""):
            (REPO, (*args.common, *args.settings))}
    if args.baseline is not None:
        ways = {f"baseline, {commit_of(args.baseline)}": (args.baseline.resolve(), tuple(args.common)), **ways}
    results: dict[str, list[dict]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        data, model = Path(tmp) / "texts.tsv", Path(tmp) / "model"
        if args.predict:
            from bench.predict_processes import save_small_model
            save_small_model(model)
        else:
            write_rows(data, args.rows)
        for _ in range(args.rounds):
            for name, (checkout, settings) in ways.items():
                result = (time_prediction(checkout, model, Path(tmp)) if args.predict
                          else time_data_error(checkout, data, Path(tmp)) if args.data_error
                          else time_setup(checkout, data, Path(tmp), args.dry_run, settings))
                results[name].append(result)
                print(f"{name}: {json.dumps(result)}", file=sys.stderr)
    command = " ".join(["python -m bench.startup", *(argv if argv is not None else sys.argv[1:])])
    shown = (table(results, "seconds to the prediction") if args.predict
             else data_error_table(results) if args.data_error else dry_run_table(results) if args.dry_run
             else table(results))
    print("\n".join([f"Command: `{command}`", "", *shown]))
    return 0


def table(results: dict[str, list[dict]], what: str = "`setup_run` seconds") -> list[str]:
    lines = [f"| way | {what} (median) | rounds |", "| --- | ---: | --- |"]
    for name, rounds in results.items():
        values = [r["seconds"] for r in rounds]
        lines.append(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    return lines


def dry_run_table(results: dict[str, list[dict]]) -> list[str]:
    lines = ["| way | rehearsal seconds (median) | its estimate of an evaluation | the evaluation | rounds |",
             "| --- | ---: | ---: | ---: | --- |"]
    for name, rounds in results.items():
        median = {key: statistics.median(r[key] for r in rounds) for key in ("seconds", "estimate", "evaluation")}
        each = "; ".join(f"{r['seconds']:.1f} ({r['estimate']:.1f} for {r['evaluation']:.1f})" for r in rounds)
        lines.append(f"| {name} | {median['seconds']:.1f} | {median['estimate']:.1f} | {median['evaluation']:.1f} "
                     f"| {each} |")
    return lines


def data_error_table(results: dict[str, list[dict]]) -> list[str]:
    lines = ["| way | seconds to the error (median) | rounds | the error |", "| --- | ---: | --- | --- |"]
    for name, rounds in results.items():
        values = [r["seconds"] for r in rounds]
        lines.append(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} "
                     f"| `{rounds[-1]['error'][:90]}` |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
