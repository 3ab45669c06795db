"""``per_device_train_batch_size: auto``: back off on out-of-memory, keep ``B`` and the math.

An out-of-memory error is simulated on the CPU: the model's forward raises
``torch.OutOfMemoryError`` for training micro-batches above a threshold.
"""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from finetune.autobatch import choose_micro_batch, initial_micro_batch
from finetune.config import config_from_dict
from finetune.errors import ConfigError, LaunchError
from finetune.modeling import is_checkpointing, load_model_reporting as _LOAD_MODEL
import forked
from helpers import free_port, make_texts, offline_env, save_tiny_model, write_tsv

B = 32


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    # 70 rows, 20% validation: 56 training samples, so windows of 32 and 24 (a ragged last one)
    return save_tiny_model(root / "tiny-bert"), write_tsv(root / "sms.csv", make_texts(70, seed=4))


def _config(assets, tmp_path, b, **data_settings):
    model, data = assets
    return config_from_dict({
        # dropout on: the trial step must not shift the random stream the run's dropout draws from
        "model": {"name_or_path": str(model), "dropout": 0.1},
        "data": {"train_file": str(data), "format": "tsv", "has_header": False, "column_names": ["label", "text"],
                 "validation_split": 0.2, "max_length": 32, **data_settings},
        "training": {"per_device_train_batch_size": b, "effective_batch_size": B, "seed": 3},
        "optim": {"learning_rate": 1e-3, "warmup_steps": 1},
        "evaluation": {"metrics": ["accuracy"]},
        "output": {"output_dir": str(tmp_path / f"out-{b}")},
    })


def _oom_above(threshold: int, seen: list[tuple[int, int]], recomputing: int = 0, probing: tuple = ()):
    """``load_model_reporting`` whose model runs out of memory on training micro-batches of more padded tokens
    than ``threshold`` rows of the widest micro-batch seen (memory follows rows x padded length; the trial's
    worst-case batch comes first and is the widest), or ``recomputing`` rows with gradient checkpointing on.
    ``seen`` gets each micro-batch's (rows, length), but the memory plan's probe's (while ``probing`` is not
    empty), which run out of memory by the same rule."""
    real = _LOAD_MODEL  # not the wrapper an earlier call of the same test left in place

    def load(*args, **kwargs):
        model, new_head = real(*args, **kwargs)
        forward = model.forward

        def limited(**batch):
            rows, length = batch["input_ids"].shape
            if model.training:
                if not probing:
                    seen.append((rows, length))
                widest = max([width for _, width in seen] + [length])
                if rows * length > (recomputing if is_checkpointing(model) else threshold) * widest:
                    raise torch.OutOfMemoryError(f"simulated: CUDA out of memory. Tried {rows} rows of {length}")
            return forward(**batch)

        model.forward = limited
        return model, new_head

    return load


def _flagged(probing: list):
    """``measure_activations`` (the memory plan's probe: on a CPU before the automatic micro-batch's trials too),
    with ``probing`` not empty while it runs."""
    from finetune.memory import measure_activations

    def measure(*args, **kwargs):
        probing.append(True)
        try:
            return measure_activations(*args, **kwargs)
        finally:
            probing.pop()

    return measure


def _train(cfg, monkeypatch, threshold, recomputing=0):
    from accelerate.state import AcceleratorState, GradientState

    from finetune.loop import train_one_epoch
    from finetune.assembly import setup_run

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    seen: list[tuple[int, int]] = []
    probing: list[bool] = []
    monkeypatch.setattr("finetune.modeling.load_model_reporting", _oom_above(threshold, seen, recomputing, probing))
    monkeypatch.setattr("finetune.autobatch.measure_activations", _flagged(probing))
    run = setup_run(cfg)
    train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader, run.accelerator, 0,
                    state=run.state, max_grad_norm=1.0)
    weights = {n: p.detach().clone() for n, p in run.accelerator.unwrap_model(run.model).named_parameters()}
    return run, weights, seen


def test_initial_micro_batch_is_the_largest_power_of_two_dividing_the_share():
    assert initial_micro_batch(32, 1) == 32
    assert initial_micro_batch(48, 1) == 16
    assert initial_micro_batch(96, 2) == 16
    assert initial_micro_batch(24, 2) == 4
    assert initial_micro_batch(7, 1) == 1
    with pytest.raises(ConfigError, match="not a multiple of the 2 processes"):
        initial_micro_batch(33, 2)


def test_auto_needs_the_effective_batch():
    base = {"data": {"train_file": "x.csv"}}
    with pytest.raises(ConfigError, match="auto needs training.effective_batch_size"):
        config_from_dict({**base, "training": {"per_device_train_batch_size": "auto"}})
    with pytest.raises(ConfigError, match="k is derived"):
        config_from_dict({**base, "training": {"per_device_train_batch_size": "auto", "effective_batch_size": 32,
                                               "gradient_accumulation_steps": 2}})
    cfg = config_from_dict({**base, "training": {"per_device_train_batch_size": "auto", "effective_batch_size": 32}})
    assert cfg.training.per_device_train_batch_size == "auto"


def test_auto_backs_off_and_trains_as_the_chosen_batching(assets, tmp_path, monkeypatch, caplog,
                                                          fresh_accelerate_state):
    with caplog.at_level(logging.DEBUG, logger="finetune"):
        auto, auto_weights, seen = _train(_config(assets, tmp_path, "auto"), monkeypatch, threshold=8)
    # tried 32 and 16 (out of memory), then 8: halving b and doubling k, B unchanged
    assert [rows for rows, _ in seen[:3]] == [32, 16, 8]
    assert (auto.batching.per_device_batch_size, auto.batching.gradient_accumulation_steps) == (8, 4)
    assert auto.batching.effective_batch_size == B
    assert auto.accelerator.gradient_accumulation_steps == 4
    assert auto.train_dataloader.total_batch_size == 8
    assert auto.plan.total_updates == 2  # 56 samples in windows of 32: the schedule still counts B-sized updates
    assert "auto micro-batch: b=8, k=4" in caplog.text

    direct, direct_weights, direct_seen = _train(_config(assets, tmp_path, 8), monkeypatch, threshold=8)
    # balanced cuts may put more than 8 short texts in a micro-batch, never more padded tokens than 8 long ones
    widest = max(length for _, length in direct_seen)
    assert all(rows * length <= 8 * widest for rows, length in direct_seen)
    # the trial steps left no trace: same weights, bit for bit, as a run started at b=8, k=4
    assert auto_weights.keys() == direct_weights.keys()
    for name, tensor in direct_weights.items():
        assert torch.equal(auto_weights[name], tensor), name
    # and training moved them (a run that did nothing would also compare equal)
    assert auto.state.step == direct.state.step == 2


def test_auto_tries_chunked_texts_with_all_their_windows_and_trains_as_the_chosen_batching(
        assets, tmp_path, monkeypatch, fresh_accelerate_state):
    """Under data.truncation: chunks a trial's b texts bring every window: the memory is the windows'."""
    chunks = {"max_length": 8, "truncation": "chunks", "stride": 2}
    auto, auto_weights, seen = _train(_config(assets, tmp_path, "auto", **chunks), monkeypatch, threshold=40)
    b = auto.batching.per_device_batch_size
    assert b < 32 and auto.batching.effective_batch_size == B  # 32 texts' windows did not fit: b was halved
    # the first trial: the 32 longest texts, each with its windows (several each: more rows than texts)
    assert seen[0][0] > 2 * 32
    direct, direct_weights, _ = _train(_config(assets, tmp_path, b, **chunks), monkeypatch, threshold=40)
    for name, tensor in direct_weights.items():
        assert torch.equal(auto_weights[name], tensor), name
    assert auto.state.step == direct.state.step == 2


def test_auto_gives_up_when_nothing_fits(assets, tmp_path, monkeypatch, fresh_accelerate_state):
    with pytest.raises(LaunchError, match=r"even b=1 ran out of memory \(on at least one process\), "
                                          r"with gradient checkpointing too; lower"):
        _train(_config(assets, tmp_path, "auto"), monkeypatch, threshold=0)
    cfg = _config(assets, tmp_path, "auto")
    cfg.training.gradient_checkpointing = False  # without the lever: the message names none
    with pytest.raises(LaunchError, match="even b=1 ran out of memory \\(on at least one process\\); lower"):
        _train(cfg, monkeypatch, threshold=0)


def test_a_job_that_fits_no_micro_batch_trains_with_checkpointing(assets, tmp_path, monkeypatch,
                                                                  fresh_accelerate_state):
    # nothing fits without recomputation (not even b=1); with it, 8 rows do
    auto, auto_weights, seen = _train(_config(assets, tmp_path, "auto"), monkeypatch, threshold=0, recomputing=8)
    assert (auto.batching.per_device_batch_size, auto.batching.gradient_accumulation_steps) == (8, 4)
    assert auto.checkpointing.on and auto.checkpointing.why == "auto: b=8 with it, none without"
    assert auto.state.step == 2  # trained to the end
    # the levers in order: the micro-batch halved to 1 without it, then from 32 again with it
    assert [rows for rows, _ in seen[:9]] == [32, 16, 8, 4, 2, 1, 32, 16, 8]
    # and it trained as a run set to b=8 with checkpointing: the trials left no trace
    cfg = _config(assets, tmp_path, 8)
    cfg.training.gradient_checkpointing = True
    direct, direct_weights, _ = _train(cfg, monkeypatch, threshold=0, recomputing=8)
    for name, tensor in direct_weights.items():
        assert torch.equal(auto_weights[name], tensor), name


def test_checkpointing_stays_off_when_the_micro_batch_is_useful_without_it(assets, tmp_path, monkeypatch,
                                                                           fresh_accelerate_state):
    auto, _, _ = _train(_config(assets, tmp_path, "auto"), monkeypatch, threshold=8, recomputing=32)
    assert not auto.checkpointing.on and auto.checkpointing.why == "auto: b=8 fits without it"
    # below min(8, B/P) without it and larger with it: on
    auto, _, _ = _train(_config(assets, tmp_path, "auto"), monkeypatch, threshold=4, recomputing=32)
    assert auto.checkpointing.on and auto.batching.per_device_batch_size == 32
    # below it without, but no larger with it: off again, its memory for nothing
    auto, _, _ = _train(_config(assets, tmp_path, "auto"), monkeypatch, threshold=4, recomputing=4)
    assert not auto.checkpointing.on and auto.checkpointing.why == "auto: b=4 either way"
    # an effective batch under 8 that fits whole has nothing to gain: off, without a trial of it
    small = _config(assets, tmp_path, "auto")
    small.training.effective_batch_size = 4
    auto, _, _ = _train(small, monkeypatch, threshold=4, recomputing=32)
    assert not auto.checkpointing.on and auto.checkpointing.why == "auto: b=4 fits without it"
    # a set micro-batch has nothing to fit: auto is off, true is on
    fixed, _, _ = _train(_config(assets, tmp_path, 8), monkeypatch, threshold=64)
    assert not fixed.checkpointing.on and fixed.checkpointing.why == "auto: the micro-batch is set"


class _OneProcess:
    num_processes = 1


def _autocast_before_accelerate_1_11(self, autocast_handler=None):
    """``Accelerator.autocast`` as Accelerate 1.7 to 1.10 wrote it: its exit is skipped when the block raises."""
    from accelerate.utils import get_mixed_precision_context_manager

    context = get_mixed_precision_context_manager(self.native_amp, autocast_handler or self.autocast_handler)
    context.__enter__()
    yield
    context.__exit__(*sys.exc_info())


def _autocast_levels() -> int:
    """autocast's open levels (torch reads them only by moving them)."""
    levels = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return levels


def test_a_trial_that_runs_out_of_memory_leaves_autocast_as_it_found_it(fresh_accelerate_state, monkeypatch):
    """A bf16 trial that runs out of memory in its forward pass must close its autocast: left open, autocast's
    cache keeps the weights' first bf16 copies, and every later forward pass computes with them. The
    Accelerate releases the floor allows (before 1.11) skip the exit of ``accelerator.autocast()`` on a raise."""
    import contextlib

    from accelerate import Accelerator

    from finetune.autobatch import trial_step
    from helpers import tiny_bert

    monkeypatch.setattr(Accelerator, "autocast", contextlib.contextmanager(_autocast_before_accelerate_1_11))
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_bert(seed=0)
    forward, inside = model.forward, []

    def forward_then_out_of_memory(**batch):
        inside.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        logits = forward(**batch).logits
        if len(inside) > 1:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return type("Output", (), {"logits": logits})

    model.forward = forward_then_out_of_memory
    batch = {"input_ids": torch.randint(5, 30, (4, 8)), "attention_mask": torch.ones(4, 8, dtype=torch.long),
             "labels": torch.tensor([0, 1, 0, 1])}
    assert trial_step(model, batch, accelerator) is True
    assert trial_step(model, batch, accelerator) is False
    assert inside == [(True, torch.bfloat16)] * 2  # each trial ran in the run's precision
    assert not torch.is_autocast_enabled("cpu") and _autocast_levels() == 0


def test_choose_micro_batch_keeps_b_times_k(fresh_accelerate_state):
    fits_up_to = 6
    chosen = choose_micro_batch(None, lambda b: b, _OneProcess(), 96, start=32,
                                trial=lambda model, batch, acc: batch <= fits_up_to)
    assert chosen == (4, 24)


@pytest.mark.slow
def test_every_process_backs_off_when_one_runs_out_of_memory(tmp_path):
    """Two gloo processes: only rank 1 runs out of memory above b=4, both must settle on b=4."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import sys\n"
        "from accelerate import Accelerator\n"
        "from finetune.autobatch import choose_micro_batch\n"
        "acc = Accelerator(cpu=True)\n"
        "limit = 4 if acc.process_index == 1 else 10**6\n"
        "b, k = choose_micro_batch(None, lambda b: b, acc, 64, start=64, trial=lambda m, batch, a: batch <= limit)\n"
        "print(f'rank={acc.process_index} world={acc.num_processes} b={b} k={k}', flush=True)\n"
        # leave together and close gloo: a process exiting with the group alive can abort at teardown
        "acc.wait_for_everyone()\n"
        "import torch.distributed\n"
        "torch.distributed.destroy_process_group()\n",
        encoding="utf-8",
    )
    proc = forked.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       str(free_port()), str(worker)], env=offline_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two ranks share one pipe: their lines may run together
    lines = sorted(re.findall(r"rank=\d world=\d b=\d+ k=\d+", proc.stdout))
    # 64 = b * k * P on both ranks: b=4, k=8, P=2
    assert lines == ["rank=0 world=2 b=4 k=8", "rank=1 world=2 b=4 k=8"]
