"""What an out-of-memory stop suggests, for each kind of run (the stops themselves, and a hint followed to the end
of the run, are in tests/test_never_lose_a_run.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from finetune.out_of_memory import hint_line, memory_saving_settings

CHECKPOINTS = [Path("out/checkpoints/checkpoint-40")]


def memory_saving_hint(run, b: int, k: int, newest: list) -> str:
    """The training hint as the error says it."""
    return hint_line(*memory_saving_settings(run, b, k), newest)


def run(b=8, k=4, B=32, given_B=True, schedule=None, engine=DistributedType.NO, checkpointing=False,
        optimizer="adamw"):
    training = SimpleNamespace(effective_batch_size=B if given_B else None, accumulation_schedule=schedule)
    return SimpleNamespace(cfg=SimpleNamespace(training=training, optim=SimpleNamespace(optimizer=optimizer)),
                           batching=SimpleNamespace(effective_batch_size=B),
                           accelerator=SimpleNamespace(distributed_type=engine),
                           checkpointing=SimpleNamespace(on=checkpointing))


def test_half_the_micro_batch_at_twice_k_keeps_the_effective_batch():
    assert memory_saving_hint(run(), 8, 4, CHECKPOINTS) == (
        "the same command with training.per_device_train_batch_size=4 resumes it from checkpoint-40: k=8, the "
        "same updates (effective batch 32) on about half the activation memory")


def test_a_config_that_gives_k_is_told_to_give_its_effective_batch_too():
    # typed on the command line, effective_batch_size replaces the file's gradient_accumulation_steps
    hint = memory_saving_hint(run(given_B=False), 8, 4, CHECKPOINTS)
    assert "training.per_device_train_batch_size=4 training.effective_batch_size=32 resumes it" in hint


def test_without_a_checkpoint_the_folder_is_started_afresh_on_request():
    hint = memory_saving_hint(run(), 8, 4, [])
    assert hint.startswith("the same command with training.per_device_train_batch_size=4 output.overwrite=true "
                           "starts it again (it saved no checkpoint)")


@pytest.mark.parametrize("kind", [
    dict(b=3),  # no half of an odd micro-batch
    dict(schedule={0: 4, 2: 2}),  # a schedule gives k per epoch: another b would be another B
    dict(engine=DistributedType.FSDP),  # sharded checkpoints resume on their own split only
    dict(engine=DistributedType.DEEPSPEED),
])
def test_where_the_split_cannot_change_gradient_checkpointing_is_the_lever(kind):
    b = kind.pop("b", 8)
    hint = memory_saving_hint(run(b=b, **kind), b, 4, CHECKPOINTS)
    assert hint.startswith("the same command with training.gradient_checkpointing=true resumes it from "
                           "checkpoint-40: the same updates")


def test_with_checkpointing_on_already_the_levers_that_start_a_new_run_are_named():
    hint = memory_saving_hint(run(b=1, checkpointing=True), 1, 32, CHECKPOINTS)
    assert "data.max_length" in hint and "model.lora_rank" in hint and "new run" in hint
    assert "optim.optimizer=adamw_8bit" in hint
    assert memory_saving_settings(run(b=1, checkpointing=True), 1, 32)[0] is None  # nothing that keeps the run
    # a run in 8 bits already is not told to take them
    assert "adamw_8bit" not in memory_saving_hint(run(b=1, checkpointing=True, optimizer="adamw_8bit"), 1, 32,
                                                  CHECKPOINTS)
