"""``finetune/train.py`` with test-only faults injected from the environment.

Run as ``python tests/interrupt_worker.py --config ...`` (or under ``accelerate launch``):

* ``FINETUNE_TEST_SIGNAL=<update>:<SIGTERM|SIGINT>`` sends that signal to this
  process right after the given update (a real signal, handled by the real
  handler, as a preemption would arrive mid-run); with ``FINETUNE_TEST_SIGNAL_RANK=<r>``
  only to the process of that rank.
* ``FINETUNE_TEST_KILL_SAVING=<update>`` SIGKILLs this process while it saves the
  checkpoint of that update: every file written, the directory not yet renamed.
* ``FINETUNE_TEST_NAN_AT=<n>`` makes the model return NaN logits on its ``n``-th
  training forward pass (from 0, counted over the whole run; the memory plan's probe is not training).
* ``FINETUNE_TEST_ENOSPC_AT=<update>`` makes the write of that update's checkpoint fail
  as a full disk does (``OSError(ENOSPC)`` once its files are written).
* ``FINETUNE_TEST_SIGNAL_IN_FINAL_WRITE=<SIGTERM|SIGINT>`` sends that signal while the
  final model is being written.
* ``FINETUNE_TEST_OOM=<n>:<rows>`` makes the device run out of memory (``torch.OutOfMemoryError``) on every
  training micro-batch of more than ``rows`` rows from the ``n``-th training forward pass on (from 0), as a
  device that fits ``rows`` would; ``FINETUNE_TEST_OOM_EVAL=<rows>`` does so on evaluation batches.

Nothing here is imported by the package; it only wraps it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import finetune.checkpoint  # noqa: E402
import finetune.checkpoint_files  # noqa: E402
import finetune.modeling  # noqa: E402
import finetune.signals  # noqa: E402
from finetune.train import main  # noqa: E402


def _signal_at(spec: str) -> None:
    step_spec, name = spec.split(":")
    sig = getattr(signal, name)
    original = finetune.signals.StopSignals.agree

    # the agreement runs on every process after every update: the signal arrives just before it
    def agree(self, accelerator, step=None):
        rank = os.environ.get("FINETUNE_TEST_SIGNAL_RANK")
        if rank is not None and os.environ.get("RANK", "0") != rank:
            return original(self, accelerator, step)
        if step == int(step_spec) and not getattr(self, "_test_signalled", False):
            self._test_signalled = True
            os.kill(os.getpid(), sig)
        return original(self, accelerator, step)

    finetune.signals.StopSignals.agree = agree


def _kill_saving(step: str) -> None:
    original = finetune.checkpoint_files._fsync_tree

    def fsync_tree(path):
        if path.name == f"{finetune.checkpoint_files.TMP_PREFIX}{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path)

    finetune.checkpoint_files._fsync_tree = fsync_tree


def _hook_training_forwards(hook) -> None:
    """Call ``hook(module, output, n)`` after every training forward pass of the run's model, the ``n``-th from 0
    (the memory plan's probe aside: its forward passes are not training's), and ``hook(module, output, None)`` after
    every forward pass in evaluation."""
    import finetune.autobatch

    original = finetune.modeling.load_model_reporting
    calls = {"n": 0}
    probe, probing = finetune.autobatch.measure_activations, [False]

    def measure_activations(*args, **kwargs):
        probing[0] = True
        try:
            return probe(*args, **kwargs)
        finally:
            probing[0] = False

    finetune.autobatch.measure_activations = measure_activations

    def counted(module, args, output):
        if probing[0]:
            return output
        if not module.training:
            return hook(module, output, None)
        calls["n"] += 1
        return hook(module, output, calls["n"] - 1)

    def load_model_reporting(*args, **kwargs):
        model, new_head = original(*args, **kwargs)
        model.register_forward_hook(counted)
        return model, new_head

    finetune.modeling.load_model_reporting = load_model_reporting


def _nan_at(index: int) -> None:
    def hook(module, output, n):
        if n == index:
            output.logits = output.logits * float("nan")  # still in the graph: backward runs as for a real NaN
        return output

    _hook_training_forwards(hook)


def _oom(spec: str, eval_rows: str) -> None:
    import torch

    start, rows = (int(x) for x in spec.split(":")) if spec else (None, None)

    def hook(module, output, n):
        limit = rows if n is not None and start is not None and n >= start else None
        limit = int(eval_rows) if n is None and eval_rows else limit
        if limit is not None and output.logits.shape[0] > limit:
            raise torch.OutOfMemoryError(f"out of memory (test): {output.logits.shape[0]} rows, room for {limit}")
        return output

    _hook_training_forwards(hook)


def _enospc_at(step: str) -> None:
    import errno

    original = finetune.checkpoint._write_state

    def write_state(run, tmp, *args, **kwargs):
        original(run, tmp, *args, **kwargs)  # the files are written, then the disk is full
        if tmp.name == f"{finetune.checkpoint_files.TMP_PREFIX}{step}":
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / finetune.checkpoint_files.STATE_FILE))

    finetune.checkpoint._write_state = write_state


def _signal_in_final_write(name: str) -> None:
    import finetune.results

    original = finetune.results.save_model

    def save_model(run, directory):
        os.kill(os.getpid(), getattr(signal, name))
        return original(run, directory)

    finetune.results.save_model = save_model


if __name__ == "__main__":
    if os.environ.get("FINETUNE_TEST_ENOSPC_AT"):
        _enospc_at(os.environ["FINETUNE_TEST_ENOSPC_AT"])
    if os.environ.get("FINETUNE_TEST_SIGNAL_IN_FINAL_WRITE"):
        _signal_in_final_write(os.environ["FINETUNE_TEST_SIGNAL_IN_FINAL_WRITE"])
    if os.environ.get("FINETUNE_TEST_SIGNAL"):
        _signal_at(os.environ["FINETUNE_TEST_SIGNAL"])
    if os.environ.get("FINETUNE_TEST_KILL_SAVING"):
        _kill_saving(os.environ["FINETUNE_TEST_KILL_SAVING"])
    if os.environ.get("FINETUNE_TEST_NAN_AT"):
        _nan_at(int(os.environ["FINETUNE_TEST_NAN_AT"]))
    if os.environ.get("FINETUNE_TEST_OOM") or os.environ.get("FINETUNE_TEST_OOM_EVAL"):
        _oom(os.environ.get("FINETUNE_TEST_OOM", ""), os.environ.get("FINETUNE_TEST_OOM_EVAL", ""))
    sys.exit(main(sys.argv[1:]))
