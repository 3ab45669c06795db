"""Which checkpoints may resume on another split of the effective batch, and where the epoch goes on.

The resumes themselves (two processes to one and one to two, ending with the model of every other split)
are in tests/test_scaling.py.
"""

from __future__ import annotations

import pytest

import finetune.resuming as resuming
from finetune.resplit import k_in_epoch, may_change_split, micro_batch_on_new_split, split_change


def fingerprint(b: int, k: int, P: int, B: int | None = None, sharded: str | None = None, **more) -> dict:
    """The keys of finetune.resuming.run_fingerprint that the split touches, with one config key."""
    return {"optim.learning_rate": 1e-3, "effective_batch_size": B or b * k * P, "sharded_state": sharded,
            "processes": P, "per_device_train_batch_size": b, "gradient_accumulation_steps": k,
            "plan.accumulation": [k, k], **more}


@pytest.mark.parametrize("micro_batch, old_k, new_k, per_epoch, expected", [
    (6, 2, 4, 14, 12),  # 3 windows of 2 micro-batches, then of 4
    (12, 4, 2, 7, 6),  # and back, on twice the processes
    (0, 2, 4, 14, 0),  # at an epoch's start
    (7, 2, 4, 14, 14),  # the end of an epoch of 7 micro-batches (a ragged last window), on half the processes
    (14, 4, 2, 7, 7),  # the end of an epoch of 14 (4 windows), on twice the processes: not 4 x 2 = 8
])
def test_the_epoch_goes_on_after_the_windows_already_trained(micro_batch, old_k, new_k, per_epoch, expected):
    assert micro_batch_on_new_split(micro_batch, old_k, new_k, per_epoch) == expected


def test_another_split_is_allowed_only_with_the_same_effective_batch_and_no_sharded_state():
    saved = fingerprint(4, 2, 2)
    assert may_change_split(saved, fingerprint(4, 4, 1))
    assert may_change_split(saved, fingerprint(2, 4, 2))
    assert not may_change_split(saved, fingerprint(4, 2, 1))  # B = 8: another run
    assert not may_change_split(fingerprint(4, 2, 2, sharded="FSDP"), fingerprint(4, 4, 1))
    assert not may_change_split(saved, fingerprint(4, 4, 1, sharded="DEEPSPEED"))
    # a checkpoint of a release that did not record the engine (or B) resumes on its own split only
    older = {key: value for key, value in saved.items() if key != "sharded_state"}
    assert not may_change_split(older, fingerprint(4, 4, 1))


def test_the_split_change_is_named_and_the_same_split_is_none():
    assert split_change(fingerprint(4, 2, 2), fingerprint(4, 4, 1)) == "(b, k, P) = (4, 2, 2) -> (4, 4, 1)"
    assert split_change(fingerprint(4, 2, 2), fingerprint(4, 2, 2)) is None
    # a checkpoint written before the plan's k per epoch was recorded, on the same split: no change (its random
    # streams are restored, not seeded afresh)
    older = {key: value for key, value in fingerprint(4, 2, 2).items() if key != "plan.accumulation"}
    assert split_change(older, fingerprint(4, 2, 2)) is None


def test_k_of_an_epoch_comes_from_the_checkpoint_plan():
    scheduled = fingerprint(4, 8, 1, **{"plan.accumulation": [8, 8, 2]})
    assert [k_in_epoch(scheduled, epoch) for epoch in (0, 2)] == [8, 2]
    assert k_in_epoch(scheduled, 3) == 8  # past the plan's epochs: a run stopped after its last update


def _changes(saved: dict, current: dict, monkeypatch) -> str | None:
    monkeypatch.setattr(resuming, "run_fingerprint", lambda run: current)
    return resuming.changed_settings({"fingerprint": saved}, run=None)


def test_a_resume_on_another_split_is_no_change_but_any_other_setting_still_is(monkeypatch):
    assert _changes(fingerprint(4, 2, 2), fingerprint(4, 4, 1), monkeypatch) is None
    changed = _changes(fingerprint(4, 2, 2), fingerprint(4, 4, 1, **{"optim.learning_rate": 2e-3}), monkeypatch)
    assert changed == "optim.learning_rate: 0.001 -> 0.002"


def test_another_effective_batch_is_refused_naming_it_first(monkeypatch):
    changed = _changes(fingerprint(4, 2, 2), fingerprint(4, 2, 1), monkeypatch)
    assert changed.startswith("effective_batch_size: 16 -> 8")


def test_a_sharded_checkpoint_on_another_split_is_refused_saying_why(monkeypatch):
    changed = _changes(fingerprint(4, 2, 2, sharded="FSDP"), fingerprint(4, 4, 1, sharded="FSDP"), monkeypatch)
    assert changed.startswith("processes: 2 -> 1")
    assert changed.endswith("(FSDP checkpoints are sharded: they resume on the b, k and P that wrote them)")
    assert "\n" not in changed


@pytest.mark.slow
def test_a_resume_on_another_split_ends_its_windows_at_the_new_k_and_draws_the_same_streams_whatever_was_saved(
        tmp_path):
    """Here one process, b=8 k=2 -> b=4 k=4, dropout on, resumed after update 3. Accelerate counts micro-batches
    to end a window, and the checkpoint holds its count at the old k (6, which would end the new window [12, 16)
    at 13): the resumed epoch counts from its own start. A checkpoint also holds one random stream per process of
    its own split, which another split cannot take over: every process is seeded afresh from the seed and the
    update instead, so that such a resume is repeatable. Resumed from a checkpoint whose saved torch stream was
    replaced by another, the run ends with the same model."""
    import shutil

    import torch

    from finetune.checkpoint_files import write_manifest
    from tiny_run import fit_tiny_run

    sections = {"model": {"dropout": 0.1}, "output": {"checkpoint_every": 3, "keep_last": None}}
    resplit = {"training": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}}
    out = tmp_path / "out"
    fit_tiny_run(tmp_path, on_update=lambda state: state.step >= 3, **sections)
    shutil.copytree(out, tmp_path / "stopped")

    def resumed() -> bytes:
        fit_tiny_run(tmp_path, **sections, **resplit)
        return (out / "model.safetensors").read_bytes()

    as_saved = resumed()
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "stopped", out)
    states = out / "checkpoints" / "checkpoint-3" / "random_states_0.pkl"
    saved = torch.load(states, weights_only=False)
    other = torch.Generator().manual_seed(12345).get_state()
    assert not torch.equal(saved["torch_manual_seed"], other)
    torch.save({**saved, "torch_manual_seed": other}, states)
    write_manifest(states.parent)
    assert resumed() == as_saved
