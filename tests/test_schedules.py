"""transformers' schedules, PEFT and bitsandbytes imported without the warnings of bitsandbytes' Hub kernel lookup
(finetune/schedules.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from helpers import REPO, offline_env

from finetune.schedules import quiet_kernel_lookup, transformers_schedules


def test_the_lookups_warnings_are_dropped_and_every_other_record_passes(caplog):
    caplog.set_level(logging.INFO)
    logging.getLogger("bitsandbytes").setLevel(logging.INFO)  # a level of its own, put back after the block
    try:
        with quiet_kernel_lookup():
            logging.getLogger("kernels._internals.hf_hub").warning("Skipping publisher trust check")
            logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
            logging.getLogger("bitsandbytes.backends.cpu.ops").error("an error still shows")
            logging.getLogger("another_library").warning("another library's warning shows")
        logging.getLogger("kernels._internals.hf_hub").warning("after the block, its warnings show again")
        assert [r.getMessage() for r in caplog.records] == [
            "an error still shows", "another library's warning shows", "after the block, its warnings show again"]
        assert logging.getLogger("bitsandbytes").level == logging.INFO
        assert logging.getLogger("kernels").level == logging.NOTSET
    finally:
        logging.getLogger("bitsandbytes").setLevel(logging.NOTSET)


def test_they_are_transformers_schedules():
    from transformers import SchedulerType, get_scheduler

    assert transformers_schedules() == (get_scheduler, SchedulerType)


@pytest.mark.slow  # a fresh Python importing transformers, PEFT and bitsandbytes: seconds
def test_a_runs_schedule_check_logs_nothing_of_the_lookup():
    """The real import chain, as a run makes it: its config check imports transformers' schedules first, with a
    handler on the root logger as train.py sets one. bitsandbytes looks the kernel up on a CPU that computes bf16
    only; elsewhere the chain is imported and logs nothing to drop."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
            "from finetune.schema import check_schedule; check_schedule('linear', {})\n"
            "print('peft' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=offline_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]  # the chain ran: transformers imported PEFT
    assert "kernels-community" not in done.stderr and "gemm_4bit" not in done.stderr, done.stderr[-2000:]


# what a LoRA run and an 8-bit AdamW run import first, before transformers' schedules
FIRST_IMPORTS = {
    "lora": "from finetune.config import ModelConfig\nfrom finetune.lora import add_lora\n"
            "from helpers import tiny_bert\nadd_lora(tiny_bert(), ModelConfig(lora_rank=4))",
    "adamw_8bit": "import torch\nfrom finetune.optimizer_state import eight_bit_adamw\n"
                  "eight_bit_adamw([{'params': [torch.nn.Parameter(torch.zeros(4))]}], lr=1e-3)",
}


@pytest.mark.slow  # a fresh Python importing PEFT and bitsandbytes: seconds
@pytest.mark.parametrize("run", FIRST_IMPORTS)
def test_a_lora_or_8bit_run_which_imports_bitsandbytes_first_logs_nothing_of_the_lookup(run):
    """Offline, the lookup logs that it skipped the publisher's trust check, once per process, wherever
    bitsandbytes is imported first: under LoRA (PEFT) or the 8-bit AdamW, before any schedule."""
    pytest.importorskip("bitsandbytes")
    code = (f"import logging, sys; logging.basicConfig(level=logging.INFO); sys.path.insert(0, 'tests')\n"
            f"{FIRST_IMPORTS[run]}\nprint('bitsandbytes' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=offline_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]  # bitsandbytes was imported here
    assert "kernels-community" not in done.stderr and "gemm_4bit" not in done.stderr, done.stderr[-2000:]
