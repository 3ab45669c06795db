"""What logging to a tracker costs the training: the host time of ``RunLogger.log`` per record.

The loop logs each update's record between the update and the next window's
first micro-batch, so the time a tracker's log call takes is added to every
update (on a GPU the device waits for it). This times ``RunLogger.log`` over
``--records`` records of a run's size, one every ``--update-ms`` (the time the
update itself takes, spent asleep here, as a host waits for its GPU), against
a real MLflow tracking store (SQLite, in a temporary folder), three ways,
alternating by round:

- no tracker (the file alone);
- MLflow as the package logs to it (``synchronous=False``: the record is queued,
  MLflow sends the queue in batches from a thread of its own);
- MLflow with each record one synchronous request, as Accelerate's tracker
  sends it (and the package did).

For each it also times the run's end (``end_training``), which waits for what
is still on its way, and checks that the store then holds every record.

    python -m bench.trackers --records 200 --update-ms 70 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

ARMS = ("no tracker", "MLflow, queued (the package)", "MLflow, one request per record")


def _record(step: int) -> dict:
    """A training record of the package's shape (its numbers; the file takes the rest as they are)."""
    return {"step": step, "epoch": step / 1000, "train/loss": 1.0 / step, "train/learning_rate": 1e-4,
            "train/grad_norm": 0.5, "train/samples": 32, "train/tokens": 1400, "train/samples_per_second": 80.0,
            "train/seconds": 0.4}


def time_arm(arm: str, records: int, folder: Path, update_s: float) -> dict:
    """Seconds per record logged, seconds of the run's end, and whether the store holds every record."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from mlflow import MlflowClient

    from finetune import tracking
    from finetune.tracker_runs import SENDERS

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    uses_mlflow = arm != "no tracker"
    acc = Accelerator(cpu=True, log_with="mlflow" if uses_mlflow else None, project_dir=str(folder))
    queued = SENDERS["mlflow"]
    if arm == ARMS[2]:  # the call as Accelerate's tracker makes it
        del SENDERS["mlflow"]
    try:
        if uses_mlflow:
            acc.init_trackers("bench")
        run_id = acc.trackers[0].active_run.info.run_id if uses_mlflow else None
        log = tracking.RunLogger(acc, folder, use_trackers=uses_mlflow)
        logged = 0.0
        for step in range(1, records + 1):
            time.sleep(update_s)
            start = time.perf_counter()
            log.log(_record(step))
            logged += time.perf_counter() - start
        start = time.perf_counter()
        acc.end_training()
        ended = time.perf_counter() - start
    finally:
        SENDERS["mlflow"] = queued
    held = len(MlflowClient().get_metric_history(run_id, "train/loss")) if uses_mlflow else records
    return {"ms_per_record": 1000 * logged / records, "end_s": ended, "held": held}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200, help="records (updates) per run")
    parser.add_argument("--update-ms", type=float, default=70.0,
                        help="milliseconds between records: the update's own time (70: bert-base on an H100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every arm once")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # MLflow's store uses a loader option the newest SQLAlchemy deprecates
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        for round_ in range(args.rounds):
            for arm in ARMS if round_ % 2 == 0 else reversed(ARMS):
                folder = Path(tmp) / f"{round_}-{ARMS.index(arm)}"
                folder.mkdir()
                results[arm].append(time_arm(arm, args.records, folder, args.update_ms / 1000))
                print(f"round {round_ + 1}: {arm}: {results[arm][-1]['ms_per_record']:.2f} ms per record",
                      file=sys.stderr)
    print(f"`python -m bench.trackers --records {args.records} --update-ms {args.update_ms:g} --rounds {args.rounds}` "
          f"(MLflow SQLite store, median of {args.rounds} rounds)\n")
    print("| how | ms per record (median) | run's end s (median) | records the store holds |")
    print("| --- | ---: | ---: | ---: |")
    for arm in ARMS:
        runs = results[arm]
        print(f"| {arm} | {statistics.median(r['ms_per_record'] for r in runs):.2f} | "
              f"{statistics.median(r['end_s'] for r in runs):.2f} | "
              f"{min(r['held'] for r in runs)} of {args.records} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
