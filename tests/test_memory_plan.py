"""The memory plan (finetune.memory): its parts, its activation estimate, and the refusal of a run that cannot fit.

How close the plan comes to a measured peak is the benchmark's to say
(bench/memory_levers.py), not a timed or memory-measuring test's.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import replace

import pytest
import torch

from finetune.config import ModelConfig
from finetune.errors import LaunchError
from finetune.lora import add_lora
from finetune.memory import _counting_saved_tensors, measure_activations, plan_memory
from finetune.modeling import is_checkpointing
from helpers import pad_collate, tiny_bert, token_dataset


class _CpuAccelerator:
    """What the probe reads of an ``Accelerator`` in fp32 on a CPU (its autocast: finetune.launch.autocast)."""

    device = torch.device("cpu")
    num_processes = 1
    native_amp = False
    autocast_handler = None


def _batches(rows: int = 40, max_len: int = 30):
    data = token_dataset(rows, seed=2, max_len=max_len)
    longest = sorted(data, key=lambda x: -len(x["input_ids"]))
    return lambda b: pad_collate([longest[i % len(longest)] for i in range(b)])


def _saved_bytes(model, batch) -> int:
    """What the whole forward pass saves, without checkpointing: the probe's two parts measured at once."""
    with _counting_saved_tensors(model) as count:
        model(**{k: v for k, v in batch.items() if k != "labels"})
    return count["saved"]


@pytest.mark.parametrize("lora", [False, True])
def test_the_plan_counts_weights_gradients_and_optimizer_state(lora):
    model = tiny_bert(dropout=0.1)
    if lora:
        model, _ = add_lora(model, ModelConfig(lora_rank=4))
    activations = measure_activations(model, _batches(), _CpuAccelerator())
    plan = plan_memory(model, activations, b=8, checkpointing=False, device=torch.device("cpu"))
    every = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert plan.weights == every and plan.gradients == trained and plan.optimizer == 2 * trained
    assert plan.total == plan.weights + plan.gradients + plan.optimizer + plan.activations
    assert (plan.gradients < plan.weights / 2) == lora  # LoRA trains a small share
    assert plan.resident == plan.weights  # the loaded model is already in the process's memory
    assert plan.available is not None and plan.available > 0  # MemAvailable of this machine


def test_the_activation_estimate_extrapolates_from_one_and_two_rows_to_any_micro_batch():
    model = tiny_bert(dropout=0.1).train()
    make = _batches()
    activations = measure_activations(model, make, _CpuAccelerator())
    longest = max(len(x["input_ids"]) for x in token_dataset(40, seed=2, max_len=30))
    assert activations.blocks == 2 and activations.length == longest
    for b in (4, 16):
        measured = _saved_bytes(model, make(b))
        saved = activations.fixed + b * (activations.per_row_other + activations.blocks * activations.per_row_block)
        # one block replayed alone counts again what the blocks share (the attention mask): a little high
        assert measured <= saved <= 1.1 * measured, b
        # a block's input is what checkpointing keeps of it: b rows x length x hidden floats
        assert activations.per_row_block_input == longest * 32 * 4
    # the estimate adds one block's backward working set, and checkpointing keeps the blocks' inputs only
    full, recomputed = activations.estimate(16, False), activations.estimate(16, True)
    assert full - saved == 16 * activations.per_row_block
    assert recomputed < full
    assert full - recomputed == 16 * activations.blocks * (activations.per_row_block - activations.per_row_block_input) \
        - 16 * activations.per_row_block
    # a probe leaves no trace: no gradient, the random stream where it was
    assert all(p.grad is None for p in model.parameters())


def test_under_autocast_the_plan_counts_the_weights_low_precision_copies_once_whatever_the_micro_batch(
        fresh_accelerate_state):
    """bf16 autocast saves a copy of each weight it multiplies by for the backward, once per micro-batch whatever
    its rows: the plan's fixed part, which an estimate per row alone would leave out."""
    from accelerate import Accelerator

    from finetune.launch import autocast
    from finetune.lora import blocks_of

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model, make = tiny_bert(dropout=0.1).train(), _batches()
    activations = measure_activations(model, make, accelerator)
    copies = sum(2 * m.weight.numel() for m in blocks_of(model).modules() if isinstance(m, torch.nn.Linear))
    assert activations.fixed >= copies
    for b in (4, 16):
        with autocast(accelerator):
            measured = _saved_bytes(model, make(b))
        saved = activations.fixed + b * (activations.per_row_other + activations.blocks * activations.per_row_block)
        assert measured <= saved <= 1.1 * measured, b


@pytest.mark.parametrize("compiled", [False, True])
def test_the_probe_counts_the_dropout_masks_training_will_save(compiled):
    """On a CPU training draws 16-bit masks (finetune.cpu) where torch saves float32 noise: the probe must see the former."""
    from types import SimpleNamespace

    from finetune.cpu import dropout_as_in_training
    from finetune.cpu.dropout import attention_switch_unavailable, fast_dropout

    model, make = tiny_bert(dropout=0.1).train(), _batches()
    training = SimpleNamespace(fast_dropout_masks=True, torch_compile=compiled, attention_kernel="auto")
    torch_dropout = measure_activations(model, make, _CpuAccelerator())
    with dropout_as_in_training(model, _CpuAccelerator(), training) as switched:
        as_trained = measure_activations(model, make, _CpuAccelerator())
    assert switched is not compiled  # a compiled run keeps torch's dropout, and so does its probe
    assert all(type(m) is torch.nn.Dropout for m in model.modules() if "Dropout" in type(m).__name__)
    if compiled:
        assert as_trained == torch_dropout
        return
    assert as_trained.per_row_block < torch_dropout.per_row_block
    switchable = attention_switch_unavailable(model.config, model) is None  # as training decides it
    with fast_dropout(model, attention=switchable):
        measured = _saved_bytes(model, make(16))
    saved = as_trained.fixed + 16 * (as_trained.per_row_other + as_trained.blocks * as_trained.per_row_block)
    # with transformers 4.x's attention (torch's SDPA dropout, not switched) the plan ran 11% over: still an
    # over-estimate, never under
    assert measured <= saved <= (1.1 if switchable else 1.15) * measured


def _tensors_in_a_graph() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None)


def test_the_probe_leaves_no_autograd_graph_alive():
    """Its graphs go with its forward passes. A graph kept alive would hold the probe's activations for the whole
    run, and the parameters' gradient accumulators with it, made on the default stream: a CUDA graph's capture,
    which runs on its own stream, would then be refused."""
    model = tiny_bert(dropout=0.1).train()
    before = _tensors_in_a_graph()
    assert measure_activations(model, _batches(), _CpuAccelerator()) is not None
    assert _tensors_in_a_graph() == before


def test_a_probe_that_runs_out_of_memory_gives_no_plan():
    model = tiny_bert()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    model.forward = out_of_memory
    assert measure_activations(model, _batches(), _CpuAccelerator()) is None


def _fails_under_autocast(model, also_in_float32: bool = False):
    """``model`` whose encoder raises what a transformers model without a kernel for the precision raises: under
    autocast only, or (``also_in_float32``) always."""
    def refuse(module, args):
        if also_in_float32 or torch.is_autocast_enabled("cpu"):
            raise RuntimeError("scatter(): Expected self.dtype to be equal to src.dtype\nmore lines of the trace")

    model.bert.encoder.register_forward_pre_hook(refuse)
    return model


@pytest.mark.parametrize("probe", ["memory plan", "micro-batch trial"])
def test_a_model_that_fails_under_autocast_alone_is_told_in_one_line_with_float32(fresh_accelerate_state, probe):
    from accelerate import Accelerator

    from finetune.autobatch import trial_step
    from finetune.errors import ConfigError

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = _fails_under_autocast(tiny_bert())
    said = (r"^training.mixed_precision: bf16: bert's forward fails under bf16 autocast \(RuntimeError: scatter\(\): "
            r"Expected self.dtype to be equal to src.dtype\) and runs in float32$")
    with pytest.raises(ConfigError, match=said) as refused:
        if probe == "memory plan":
            measure_activations(model, _batches(), accelerator)
        else:
            trial_step(model, _batches()(4), accelerator)
    assert refused.value.hint == "training.mixed_precision=no"
    assert all(p.grad is None for p in model.parameters())  # the float32 try leaves no gradient behind


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_a_model_that_fails_in_float32_too_or_without_autocast_keeps_its_own_error(fresh_accelerate_state, precision):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    model = _fails_under_autocast(tiny_bert(), also_in_float32=True)
    with pytest.raises(RuntimeError, match=r"^scatter\(\): Expected"):
        measure_activations(model, _batches(), accelerator)


def test_the_probe_leaves_the_model_as_it_found_it_without_a_word_from_transformers():
    """The probe recomputes; BERT's config has the decoder cache on, which transformers warns about under recomputation."""
    model = tiny_bert()
    assert model.config.use_cache and not is_checkpointing(model)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.Logger.warning_once.cache_clear()  # transformers says a warning once per process: let this test hear it
    logging.getLogger("transformers").addHandler(handler)
    try:
        assert measure_activations(model, _batches(), _CpuAccelerator()) is not None
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert [record.getMessage() for record in records] == []
    assert model.config.use_cache and not is_checkpointing(model)


def test_the_plan_is_said_in_one_part_of_the_start_line_and_recorded():
    model = tiny_bert()
    activations = measure_activations(model, _batches(), _CpuAccelerator())
    plan = replace(plan_memory(model, activations, b=8, checkpointing=False, device=torch.device("cpu")),
                   available=10**10 - 1000, resident=1000)
    assert plan.describe().startswith(f"memory={plan.total / 1e9:.2f}GB (weights ")
    assert plan.describe().endswith(f"at b=8 x {activations.length} tokens) of 10.0GB available")
    record = plan.record()
    assert record["total"] == plan.total and record["available"] == 10**10 and record["micro_batch"] == 8
    assert record["windows"] is None  # texts not split into windows
    from finetune.memory import memory_limit_binds

    assert record["available_under_memory_limit"] is memory_limit_binds()  # False but in a container with a limit
    # in a container whose memory limit leaves less than the machine's RAM, the line says which it is
    limited = replace(plan, limited=True)
    assert limited.describe().endswith(" tokens) of 10.0GB available under the memory limit")
    assert limited.record()["available_under_memory_limit"] is True


def test_processes_on_one_cpu_machine_each_plan_with_their_share_of_its_memory(monkeypatch):
    """Two launched processes on one machine each add their gradients, AdamW state and activations to the same
    RAM: each plan that fits the whole would, together, not. On a GPU each process has its own device."""
    from finetune.launch import processes_on_this_machine

    model = tiny_bert()
    activations = measure_activations(model, _batches(), _CpuAccelerator())
    alone = plan_memory(model, activations, b=8, checkpointing=False, device=torch.device("cpu"))
    need = alone.total - alone.resident
    monkeypatch.setattr("finetune.memory.available_memory", lambda device: 3 * need)  # room for one or two
    assert plan_memory(model, activations, b=8, checkpointing=False, device=torch.device("cpu"), processes=2).fits
    monkeypatch.setattr("finetune.memory.available_memory", lambda device: 2 * need - 2)  # not for two
    two = plan_memory(model, activations, b=8, checkpointing=False, device=torch.device("cpu"), processes=2)
    assert two.available == need - 1 and not two.fits
    assert plan_memory(model, activations, b=8, checkpointing=False, device=torch.device("cpu")).fits  # one would
    assert two.describe().endswith(f" of {(need - 1 + two.resident) / 1e9:.1f}GB available to each of 2 processes")
    assert two.record()["processes_sharing_it"] == 2
    # the processes that share a machine: the launcher's LOCAL_WORLD_SIZE (several machines), else all of them
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert processes_on_this_machine(4) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert processes_on_this_machine(4) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")  # a launcher's variable gone wrong: one line, as WORLD_SIZE's
    with pytest.raises(LaunchError, match=r"^LOCAL_WORLD_SIZE: expected a whole number of processes, got 'two'$"):
        processes_on_this_machine(4)


def test_a_chunked_plan_counts_the_windows_of_the_longest_micro_batchs_texts():
    """Under data.truncation: chunks a row of the micro-batch is a window: the plan says how many the b texts the
    activations are measured on make, the longest by their padded length, repeated where there are fewer."""
    import datasets

    from finetune.autobatch import worst_case_windows

    # length: a text's windows times the window it pads them to; chunks: its windows
    split = datasets.Dataset.from_dict({"length": [20, 90, 40, 90, 10], "chunks": [2, 9, 4, 9, 1]})
    assert worst_case_windows(split, 1) == 9 and worst_case_windows(split, 3) == 9 + 9 + 4
    assert worst_case_windows(split.select([2, 4]), 3) == 4 + 1 + 4  # two texts: the longest again
    assert worst_case_windows(split.remove_columns("chunks"), 3) is None
    model = tiny_bert()
    activations = measure_activations(model, _batches(), _CpuAccelerator())
    plan = plan_memory(model, activations, b=3, checkpointing=False, device=torch.device("cpu"),
                       windows=worst_case_windows(split, 3))
    assert f"at b=3 texts in 22 windows x {activations.length} tokens)" in plan.describe()
    assert plan.record()["windows"] == 22


# --------------------------------------------------------------------------- the refusal, in a real setup


@pytest.fixture
def tiny_job(tmp_path):
    from tiny_run import tiny_config

    return tiny_config(tmp_path, training={"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2})


def _setup(cfg, monkeypatch, available):
    from finetune.assembly import setup_run
    from tiny_run import reset_accelerate

    reset_accelerate()
    monkeypatch.setattr("finetune.memory.available_memory", lambda device: available)
    try:
        return setup_run(cfg)
    finally:
        reset_accelerate()


def test_a_set_micro_batch_that_cannot_fit_stops_before_training_naming_what_would(tiny_job, monkeypatch, tmp_path):
    from finetune.depths import layer_depths

    run = _setup(tiny_job, monkeypatch, available=10**12)
    plan = run.memory
    assert plan is not None and plan.micro_batch == 16 and plan.fits
    # a device with a little less than the plan needs beyond the loaded weights
    short = plan.total - plan.resident - 1
    with pytest.raises(LaunchError) as info:
        _setup(tiny_job, monkeypatch, available=short)
    message = info.value.message
    assert message.startswith(f"memory: the run needs about {plan.total / 1e9:.2f}GB (weights ")
    assert "\n" not in message and "training.memory_check=false trains anyway" in message
    # each lever named is one that fits alone by the plan's own arithmetic: a half micro-batch fits here
    assert "training.per_device_train_batch_size=8 (k=4)" in message
    assert "training.gradient_checkpointing=true" in message and "model.lora_rank=8" in message
    assert "model.freeze_embeddings=true" in message  # the embeddings' gradients and AdamW state are > 1 byte
    # frozen embeddings save their gradient and two moments, no more: a byte beyond that, and only LoRA fits
    depth, _ = layer_depths(run.model)
    embeddings = sum(p.numel() * p.element_size() for p in run.model.parameters() if depth[id(p)] == 0)
    with pytest.raises(LaunchError) as info:
        _setup(tiny_job, monkeypatch, available=plan.total - plan.resident - 3 * embeddings - 1)
    assert "model.freeze_embeddings=true" not in info.value.message and "model.lora_rank=8" in info.value.message
    assert not (tmp_path / "out").exists()  # nothing written
    # with nothing that fits alone, it says so
    with pytest.raises(LaunchError, match="no single setting fits: combine"):
        _setup(tiny_job, monkeypatch, available=1000)
    # memory_check: false trains anyway, and the plan is still made
    tiny_job.training.memory_check = False
    assert _setup(tiny_job, monkeypatch, available=1000).memory.total == plan.total


def test_a_smaller_micro_batch_the_plan_offers_keeps_the_effective_batch_on_several_processes():
    """Half the micro-batch on each of P processes is twice the windows' k, whatever P: B = b * k * P stays."""
    from finetune.accumulation import Batching
    from finetune.memory import levers_that_fit

    model = tiny_bert(dropout=0.1)
    activations = measure_activations(model, _batches(), _CpuAccelerator())
    plan = plan_memory(model, activations, b=16, checkpointing=False, device=torch.device("cpu"))
    short = replace(plan, available=plan.total - plan.resident - 1)  # b=16 is a byte over, b=8 fits
    for processes, k in ((1, 4), (2, 2), (4, 1)):  # B = 64
        offered = levers_that_fit(short, model, activations, Batching(16, k, processes), max_length=30)
        assert offered[0] == f"training.per_device_train_batch_size=8 (k={2 * k})", processes


def test_the_automatic_micro_batch_on_a_cpu_tries_only_what_the_plan_says_fits(tiny_job, monkeypatch):
    """On a CPU a trial step past the memory is not an error to catch but a killed process (or a swapping
    machine): the plan says first which micro-batches could fit, and only those are tried."""
    import finetune.autobatch

    tiny_job.training.per_device_train_batch_size, tiny_job.training.gradient_accumulation_steps = 8, 4
    eight = _setup(tiny_job, monkeypatch, available=10**12).memory  # B = 32 as 8 x 4: what b=8 needs
    tiny_job.training.per_device_train_batch_size = "auto"
    tiny_job.training.gradient_accumulation_steps = None
    tiny_job.training.effective_batch_size = 32
    tried = []
    real = finetune.autobatch.trial_step

    def trial(model, batch, accelerator, **options):
        tried.append(len(batch["labels"]))
        return real(model, batch, accelerator, **options)

    monkeypatch.setattr(finetune.autobatch, "trial_step", trial)
    run = _setup(tiny_job, monkeypatch, available=eight.total - eight.resident)  # b=8 fits, and no more
    assert (run.batching.per_device_batch_size, run.batching.gradient_accumulation_steps) == (8, 4)
    assert tried == [8]  # 32 and 16 were never tried: the plan refused them
    assert run.memory.total == eight.total and run.memory.fits
    # with room for nothing, it stops in one line without a trial
    tried.clear()
    with pytest.raises(LaunchError, match=r"auto found no micro-batch that fits: even b=1 does not fit in the "
                                          r"memory available by the memory plan \(on at least one process\)"):
        _setup(tiny_job, monkeypatch, available=1000)
    assert tried == []
    # memory_check: false trains anyway: every size is tried, and the trials decide (here the first fits)
    tiny_job.training.memory_check = False
    assert _setup(tiny_job, monkeypatch, available=1000).batching.per_device_batch_size == 32
    assert tried == [32]


def test_a_run_set_up_for_training_holds_no_autograd_graph(tiny_job, monkeypatch):
    """What runs before training (the automatic micro-batch's trials, the memory plan's probe) leaves no graph
    alive: a graph made there would hold the gradient accumulators a CUDA graph's capture must make afresh."""
    tiny_job.training.per_device_train_batch_size = "auto"
    tiny_job.training.gradient_accumulation_steps = None
    tiny_job.training.effective_batch_size = 32
    before = _tensors_in_a_graph()
    run = _setup(tiny_job, monkeypatch, available=10**12)
    assert run.memory is not None and run.batching.per_device_batch_size > 1  # the trials and the probe ran
    assert _tensors_in_a_graph() == before


def _resident_anonymous_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        line = next(line for line in fh if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_what_a_probe_freed_goes_back_to_the_system_before_training():
    from finetune.cpu import malloc_trim
    from finetune.memory import free_cached

    if malloc_trim() is None:
        pytest.skip("glibc's heap only")
    # many small activations (under glibc's mapping threshold, so they come from the heap), freed but for the
    # last, which pins the heap's top so that glibc cannot give the space back by itself
    blocks = [torch.ones(16 * 1024) for _ in range(4096)]  # 64 KiB each, 256 MiB in all
    keep = blocks[-1]
    del blocks
    held = _resident_anonymous_bytes()
    free_cached(torch.device("cpu"))
    assert held - _resident_anonymous_bytes() > 200 * 2**20
    assert keep.sum().item() == 16 * 1024


# --------------------------------------------------------------------------- training.cpu_heap: auto, by the plan


def _cpu_plan(total: int, available: int, resident: int = 0, device: str = "cpu"):
    from finetune.memory import MemoryPlan

    return MemoryPlan(weights=total, gradients=0, optimizer=0, activations=0, micro_batch=8, length=128,
                      checkpointing=False, device=device, available=available - resident, resident=resident)


def test_auto_keeps_the_heap_where_four_times_the_plan_fits_and_until_short_where_not():
    """glibc's kept heap held up to a few times the tensors the plan counts; released, about the plan. Where
    four plans fit in what is available (the start line's "of ...GB available", the loaded weights included), the
    faster kept heap is kept; where not, it is kept until a micro-batch comes that could not keep it."""
    from finetune.cpu import KEEP_UNTIL_SHORT, KEPT_HEAP_ROOM, heap_for

    gb = 10**9
    assert KEPT_HEAP_ROOM == 4
    assert heap_for("auto", _cpu_plan(gb, 4 * gb, resident=gb // 4)) == "keep"
    assert heap_for("auto", _cpu_plan(gb, 4 * gb - 1, resident=gb // 4)) == KEEP_UNTIL_SHORT
    assert heap_for("auto", _cpu_plan(gb, 4 * gb - 1, device="cuda")) == "keep"  # a GPU has its caching allocator
    assert heap_for("auto", None) == "keep"  # no plan (FSDP, DeepSpeed): nothing to judge by
    assert heap_for("auto", replace(_cpu_plan(gb, gb), available=None)) == "keep"
    for setting in ("keep", "trim", "release"):  # a heap set in the config is the heap, short of memory or not
        assert heap_for(setting, _cpu_plan(gb, gb)) == setting == heap_for(setting, _cpu_plan(gb, 100 * gb))


def _heap_plan(activations: int, processes: int = 1, windows=None):
    """A plan of activations alone, measured at 8 rows (or ``windows``) x 16 tokens."""
    from finetune.memory import MemoryPlan

    return MemoryPlan(weights=0, gradients=0, optimizer=0, activations=activations, micro_batch=8, length=16,
                      checkpointing=False, device="cpu", available=10**12, processes=processes, windows=windows)


def _glibc_calls(monkeypatch, free: int) -> list:
    """glibc's heap calls, recorded instead of made, with ``free`` bytes free whenever asked."""
    import finetune.cpu

    calls = []
    monkeypatch.setattr(finetune.cpu, "mallopt", lambda: lambda option, value: calls.append(("mallopt", value)) or 1)
    monkeypatch.setattr(finetune.cpu, "malloc_trim", lambda: lambda pad: calls.append(("malloc_trim", pad)) or 1)
    monkeypatch.setattr(finetune.cpu, "memory_free", lambda: free)
    return calls


def _ids(rows: int, tokens: int = 16) -> torch.Tensor:
    return torch.randint(5, 30, (rows, tokens))


def test_kept_until_short_releases_before_the_first_micro_batch_that_could_not_keep_it(monkeypatch, caplog):
    """Each training micro-batch is judged before its forward pass by its own share of the plan: 4 x (rows x
    tokens / the plan's rows x tokens) x the plan's activations against the memory free. Those that fit keep the
    heap; the first that does not releases it (glibc's threshold, then its free heap handed back), once, and says
    so; evaluation's passes, which keep no activations, are not judged."""
    from finetune.cpu import RELEASED_BLOCK, released_when_short

    calls = _glibc_calls(monkeypatch, free=2 * 10**9)
    model = tiny_bert(seed=0)
    with caplog.at_level(logging.INFO, logger="finetune"), released_when_short(model, _heap_plan(10**9)) as heap:
        model(input_ids=_ids(4))  # 4 x 0.5GB = 2GB: fits in 2GB
        with torch.no_grad():
            model(input_ids=_ids(64))  # evaluation's batch of 64: not judged
        assert calls == [] and not heap["released"]
        model(input_ids=_ids(4, tokens=17))  # one token more: 4 x 4/8 x 17/16 GB is more than 2GB
        assert calls == [("mallopt", RELEASED_BLOCK), ("malloc_trim", 0)] and heap["released"]
        model(input_ids=_ids(8))  # released for good: nothing more to judge
    assert len(calls) == 2
    assert [r.getMessage() for r in caplog.records if "cpu heap" in r.getMessage()] == [
        "cpu heap: released from a micro-batch of 4 rows x 17 tokens on: 4 x its plan (0.53GB of activations) is "
        "more than the 2.0GB free (training.cpu_heap: auto)"]


def test_kept_until_short_judges_windows_and_this_processes_share(monkeypatch):
    """Under chunks the plan is the rows the longest texts' windows make, and a micro-batch is judged by its
    windows; processes on one machine each judge by their share of what is free."""
    from finetune.cpu import released_when_short

    model = tiny_bert(seed=0)
    calls = _glibc_calls(monkeypatch, free=2 * 10**9)
    with released_when_short(model, _heap_plan(10**9, windows=32)):  # 32 windows: 1GB
        model(input_ids=_ids(16))  # 16 windows: 4 x 0.5GB fits
        assert calls == []
    calls = _glibc_calls(monkeypatch, free=2 * 10**9)
    with released_when_short(model, _heap_plan(10**9, processes=2)):  # 1GB free to each of 2
        model(input_ids=_ids(4))  # 4 x 0.5GB: not in 1GB
        assert len(calls) == 2
    calls = _glibc_calls(monkeypatch, free=10**6)
    with released_when_short(model, _heap_plan(10**9)):
        pass
    model(input_ids=_ids(8))  # outside: the hook is gone
    assert calls == []


def test_a_compiled_model_short_of_memory_is_released_from_the_start(monkeypatch):
    """A hook that reads /proc would be traced into a compiled model's graph: such a run is released as training
    starts, as before micro-batches were judged."""
    from accelerate import Accelerator

    from finetune.cpu import KEEP_UNTIL_SHORT, plan_cpu_speedups

    _glibc_calls(monkeypatch, free=10**12)
    model, plan = tiny_bert(seed=0), _heap_plan(10**9)
    eager = plan_cpu_speedups(model, Accelerator(cpu=True), heap=KEEP_UNTIL_SHORT, memory=plan)
    assert eager.release_when_short and not eager.release_heap
    model.bert.encoder.layer[0]._compiled_call_impl = model.bert.encoder.layer[0].forward  # as module.compile() marks
    compiled = plan_cpu_speedups(model, Accelerator(cpu=True), heap=KEEP_UNTIL_SHORT, memory=plan)
    assert compiled.release_heap and not compiled.release_when_short
    with pytest.raises(ValueError, match="judges each micro-batch by the run's memory plan"):
        plan_cpu_speedups(tiny_bert(seed=0), Accelerator(cpu=True), heap=KEEP_UNTIL_SHORT)


def test_a_run_short_of_memory_keeps_the_heap_until_short_says_so_and_releases_it_in_training(tiny_job,
                                                                                                 monkeypatch):
    """The decision reaches what trains (fit's speed-ups) and the start line, from the run's own plan: short of
    memory, a training micro-batch of the plan's size releases the heap; with memory, nothing is set."""
    import finetune.cpu
    from finetune.assembly import setup_run
    from finetune.cpu import M_MMAP_THRESHOLD
    from finetune.start_line import describe
    from tiny_run import reset_accelerate

    calls = []
    monkeypatch.setattr(finetune.cpu, "mallopt", lambda: lambda option, value: calls.append((option, value)) or 1)
    seen = {}
    for name, share in (("short", 3), ("ample", 5)):  # the memory available: 3 and 5 plans
        reset_accelerate()
        monkeypatch.setattr("finetune.memory.available_memory", lambda device: 10**12)
        plan = setup_run(tiny_job).memory
        monkeypatch.setattr("finetune.memory.available_memory",
                            lambda device: share * plan.total - plan.resident)
        monkeypatch.setattr(finetune.cpu, "memory_free", lambda: share * plan.total - plan.resident)
        try:
            run = setup_run(tiny_job)
            seen[name] = describe(run)
            with run.speedups():
                seen[name + " at the start"] = list(calls)
                run.model.train()
                run.model(input_ids=_ids(plan.micro_batch, plan.length))  # the plan's micro-batch
                seen[name + " after a micro-batch"] = list(calls)
        finally:
            reset_accelerate()
    assert "heap=keep_until_short (auto: 4 x the memory plan is more than the memory available)" in seen["short"]
    assert seen["short at the start"] == []  # kept as training starts
    assert seen["short after a micro-batch"] == [(M_MMAP_THRESHOLD, 1 << 20)]  # released before the first
    assert "heap=" not in seen["ample"] and seen["ample after a micro-batch"] == seen["short after a micro-batch"]
