"""``training.mixed_precision: auto``: bf16 where the hardware computes it, fp32 where it would be emulated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from finetune.precisions import choose_precision
from finetune.machine import cpu_flags, cpu_vendor


INTEL, AMD = "GenuineIntel", "AuthenticAMD"


@pytest.mark.parametrize("device, flags, vendor, cuda_bf16, expected", [
    ("cpu", {"sse2", "avx2", "avx512f", "avx512_bf16"}, AMD, None, "bf16"),  # AMD Zen 4/5: measured 1.56x fp32
    ("cpu", {"sse2", "avx2", "avx512_bf16", "amx_tile", "amx_bf16"}, INTEL, None, "bf16"),  # Sapphire Rapids on
    # a Xeon whose AMX a virtual machine hides: its bf16 products measured slower than fp32's
    ("cpu", {"sse2", "avx2", "avx512f", "avx512_bf16", "avx512_fp16"}, INTEL, None, "no"),
    ("cpu", {"sse2", "avx2", "avx512f", "avx512_bf16"}, "", None, "no"),  # a maker not named: not measured
    ("cpu", {"sse2", "avx2", "avx512f"}, AMD, None, "no"),  # AVX-512 without bf16: emulated, slower than fp32
    ("cpu", set(), "", None, "no"),  # no /proc/cpuinfo (macOS): fp32
    ("cpu", {"fp", "asimd", "sve", "bf16", "i8mm"}, "", None, "no"),  # an ARM CPU with bf16 (Graviton 3): not measured
    ("cpu", {"fp", "asimd", "atomics"}, "", None, "no"),  # an ARM CPU without (Graviton 2): emulated
    ("cuda", set(), "", True, "bf16"),  # Ampere and later
    ("cuda", set(), "", False, "no"),  # older GPUs: fp32 unless fp16 is asked for
])
def test_auto_follows_the_hardware(device, flags, vendor, cuda_bf16, expected):
    precision, why = choose_precision("auto", torch.device(device), flags=flags, vendor=vendor,
                                      cuda_bf16=cuda_bf16)
    assert precision == expected
    assert why.startswith("auto: ")
    if expected == "bf16" and device == "cpu":
        assert "bf16" in why and any(f in why for f in ("avx512_bf16", "amx_bf16"))
    if "avx512_bf16" in flags and expected == "no":  # why the instructions it has are not used, and how to
        assert "without AMX" in why and "training.mixed_precision=bf16" in why
    if "bf16" in flags:
        assert "an ARM CPU's bf16 instructions" in why and "training.mixed_precision=bf16" in why
    if device == "cpu" and not flags & {"bf16", "avx512_bf16", "amx_bf16"}:
        assert why == "auto: the CPU would emulate bf16 (no avx512_bf16, amx_bf16 or bf16 among its flags)"
    if device == "cuda" and expected == "no":  # the faster setting such a GPU has, named
        assert "training.mixed_precision=fp16" in why


@pytest.mark.parametrize("emulates, expected", [(True, "no"), (False, "bf16")])
def test_auto_asks_whether_the_gpu_computes_bf16_not_whether_it_emulates_it(monkeypatch, emulates, expected):
    """torch's ``is_bf16_supported()`` counts emulation by default: a T4 or a V100 says yes, and ``auto`` took
    bf16 there, slower than the fp32 and fp16 the docs promise. The stand-in answers as torch does on each."""
    def is_bf16_supported(including_emulation=True):
        return including_emulation or not emulates

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert choose_precision("auto", torch.device("cuda"))[0] == expected


@pytest.mark.parametrize("requested", ["no", "bf16", "fp16"])
def test_an_explicit_precision_is_kept(requested):
    assert choose_precision(requested, torch.device("cpu"), flags={"avx512_bf16"}) == (
        requested, "training.mixed_precision")


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_the_cpu_flags_are_read():
    flags, vendor = cpu_flags(), cpu_vendor()
    assert flags and all(" " not in f for f in flags)
    listed = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    assert set(listed.group(1).split()) <= flags  # x86 names them flags, ARM Features
    named = re.search(r"^vendor_id\s*:\s*(\S+)", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    assert vendor == (named.group(1) if named else "")  # GenuineIntel, AuthenticAMD; none on ARM
    assert choose_precision("auto", torch.device("cpu")) == choose_precision(
        "auto", torch.device("cpu"), flags=flags, vendor=vendor)


@pytest.mark.parametrize("device, cores, processes, expected", [
    ("cpu", 16, 1, 0),  # a worker would take a core from the forward and backward passes
    ("cuda", 16, 1, 4),
    ("cuda", 16, 8, 1),  # eight GPUs share the cores: one worker each, one core each for training
    ("cuda", 2, 1, 1),
    ("cuda", 1, 1, 0),
])
def test_auto_workers_follow_the_device_and_the_cores(monkeypatch, device, cores, processes, expected):
    from finetune.launch import choose_workers

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert choose_workers("auto", torch.device(device), processes, cores=cores) == expected
    assert choose_workers(3, torch.device(device), processes, cores=cores) == 3  # a number is kept


def _config(tmp_path, precision: str):
    from finetune.config import config_from_dict

    return config_from_dict({"data": {"dataset_name": "unused"}, "training": {"mixed_precision": precision},
                             "output": {"output_dir": str(tmp_path)}})


def test_a_second_run_in_one_process_may_take_another_precision(fresh_accelerate_state, tmp_path):
    """A notebook cell run again with another precision (or a sweep's next trial) gets it, where Accelerate
    alone refuses a process's second precision."""
    from finetune.launch import build_accelerator

    first = build_accelerator(_config(tmp_path, "no"))
    assert first.mixed_precision == "no"
    second = build_accelerator(_config(tmp_path, "bf16"))
    assert second.mixed_precision == "bf16"
    layer = torch.nn.Linear(4, 4)
    with second.autocast():
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    assert build_accelerator(_config(tmp_path, "bf16")).mixed_precision == "bf16"  # the same again: kept


def test_where_the_precision_cannot_change_the_run_says_so_in_one_line(fresh_accelerate_state, tmp_path,
                                                                        monkeypatch):
    from accelerate.state import AcceleratorState

    from finetune.errors import LaunchError
    from finetune.launch import build_accelerator, forget_an_earlier_precision

    build_accelerator(_config(tmp_path, "no"))
    with pytest.raises(LaunchError, match=r"^training.mixed_precision: bf16, but this process already trained "
                                          r"in no, .*start a new process \(or kernel\)$"):
        forget_an_earlier_precision("bf16", num_processes=2)  # the other processes would keep theirs
    monkeypatch.delattr(AcceleratorState, "_reset_state")  # an Accelerate without the private reset
    with pytest.raises(LaunchError, match="already trained in no"):
        build_accelerator(_config(tmp_path, "bf16"))


@pytest.mark.parametrize("asked, precision, device, expected", [
    ("no", "bf16", "cpu", None),  # the launcher's default, not a choice
    ("bf16", "bf16", "cuda", None),
    ("fp16", "bf16", "cuda", "fp16 (accelerate config or --mixed_precision) is not used: training.mixed_precision "
                             "decides, bf16 here; training.mixed_precision=fp16 trains in it"),
    ("fp16", "no", "cpu", "fp16 (accelerate config or --mixed_precision) is not used: training.mixed_precision "
                          "decides, no here"),  # fp16 needs a GPU: no setting to name
    ("bf16", "no", "cpu", "bf16 (accelerate config or --mixed_precision) is not used: training.mixed_precision "
                          "decides, no here; training.mixed_precision=bf16 trains in it"),
    ("fp8", "bf16", "cuda", "fp8 (accelerate config or --mixed_precision) is not used: training.mixed_precision "
                            "decides, bf16 here"),
])
def test_a_launchers_precision_the_run_does_not_use_is_named(asked, precision, device, expected):
    from finetune.launch import launcher_precision_ignored

    said = launcher_precision_ignored(precision, torch.device(device), env={"ACCELERATE_MIXED_PRECISION": asked})
    assert said == (None if expected is None else f"the launcher's mixed precision {expected}")
    assert launcher_precision_ignored(precision, torch.device(device), env={}) is None  # no launcher


def test_a_run_launched_with_another_precision_trains_in_its_own_and_says_so(fresh_accelerate_state, tmp_path,
                                                                             monkeypatch, caplog):
    from finetune.launch import build_accelerator

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # as `accelerate launch --mixed_precision bf16` sets
    with caplog.at_level("WARNING", logger="finetune"):
        accelerator = build_accelerator(_config(tmp_path, "no"))
    assert accelerator.mixed_precision == "no"
    assert [r.getMessage() for r in caplog.records] == [
        "the launcher's mixed precision bf16 (accelerate config or --mixed_precision) is not used: "
        "training.mixed_precision decides, no here; training.mixed_precision=bf16 trains in it"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="finetune"):
        assert build_accelerator(_config(tmp_path, "bf16")).mixed_precision == "bf16"
    assert not caplog.records  # the launcher's precision is the run's


@pytest.mark.parametrize("torch_compile, expected", [
    (False, "off here; training.torch_compile=blocks compiles each encoder block"),
    ("blocks", "each encoder block here"),
    (True, "the whole forward here"),
])
def test_a_launchers_compile_the_run_does_not_make_is_named(torch_compile, expected):
    from finetune.launch import launcher_compile_ignored

    said = launcher_compile_ignored(torch_compile, env={"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})
    assert said == ("the launcher's dynamo backend inductor (accelerate config or --dynamo_backend) is not used: "
                    f"training.torch_compile decides, {expected}")
    assert launcher_compile_ignored(torch_compile, env={"ACCELERATE_DYNAMO_BACKEND": "NO"}) is None
    assert launcher_compile_ignored(torch_compile, env={}) is None


def test_a_run_launched_with_a_dynamo_backend_prepares_its_model_uncompiled(fresh_accelerate_state, tmp_path,
                                                                           monkeypatch, caplog):
    """Accelerate left to read the launcher's backend compiles the whole model in prepare, again at each new
    micro-batch length: a 12-update run of the default job took 2:15 where it takes 15 s."""
    from finetune.launch import build_accelerator

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # as `accelerate launch --dynamo_backend inductor`
    with caplog.at_level("WARNING", logger="finetune"):
        accelerator = build_accelerator(_config(tmp_path, "no"))
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    assert type(model) is torch.nn.Linear  # not torch.compile's OptimizedModule
    assert [r.getMessage() for r in caplog.records] == [
        "the launcher's dynamo backend inductor (accelerate config or --dynamo_backend) is not used: "
        "training.torch_compile decides, off here; training.torch_compile=blocks compiles each encoder block"]


def test_batches_are_copied_to_a_gpu_asynchronously(fresh_accelerate_state, tmp_path):
    """Accelerate's default copy waits for the GPU at every micro-batch; the package's does not there (the GPU
    test counts the waits: tests/test_gpu.py), and copies nothing on a CPU."""
    from finetune.launch import build_accelerator, copies_asynchronously

    assert copies_asynchronously(torch.device("cuda", 0))
    assert not copies_asynchronously(torch.device("cpu")) and not copies_asynchronously(torch.device("mps"))
    accelerator = build_accelerator(_config(tmp_path, "no"))
    assert accelerator.dataloader_config.non_blocking is copies_asynchronously(accelerator.device)
