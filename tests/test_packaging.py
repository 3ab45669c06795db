"""The wheel: ``pip install .`` (not editable) carries the configs, and the default run works from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO, offline_env


@pytest.mark.slow
def test_the_wheel_trains_with_the_default_config_from_anywhere(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(REPO)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = wheels.glob("finetune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "finetune/configs/default.yaml" in names and "finetune/configs/accelerate/multi_gpu.yaml" in names

    # A fresh venv with the wheel; its requirements come from this environment's site-packages, added by a
    # plain path line (no .pth processing there, so this checkout's editable install does not shadow the wheel).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w", encoding="utf-8") as fh:
        fh.writelines(p + "\n" for p in sys.path if p.endswith("site-packages"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)

    work = tmp_path / "elsewhere"  # not the checkout: the config must come from the installed package
    work.mkdir()
    env = offline_env({"PYTHONPATH": ""})
    where = subprocess.run([str(python), "-c", "import finetune, finetune.config as c; print(finetune.__file__); "
                            "print(c.DEFAULT_CONFIG)"], cwd=work, env=env, check=True, capture_output=True,
                           text=True).stdout.split()
    assert where[0].startswith(str(venv)) and where[1].startswith(str(venv))
    proc = subprocess.run([str(venv / "bin" / "finetune"), "train", "training.max_steps=2",
                           "data.max_eval_samples=16", "logging.progress_bar=false", "output.output_dir=out"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((work / "out" / "metrics.json").read_text())
    assert metrics["train"]["updates"] == 2 and metrics["labels"] == ["ham", "spam"]


def _own_data_block() -> list[str]:
    """The README's "Your own data" commands, as written (comments dropped)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Your own data", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _write_reviews(folder, rows) -> None:
    """The README's example files: reviews.csv and reviews.jsonl (sentence, sentiment) and reviews/<label>/."""
    import csv

    with open(folder / "reviews.csv", "w", encoding="utf-8", newline="") as fh:
        csv.writer(fh).writerows([("sentence", "sentiment"), *((text, label) for label, text in rows)])
    with open(folder / "reviews.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"sentence": text, "sentiment": label}) + "\n" for label, text in rows)
    for i, (label, text) in enumerate(rows):
        (folder / "reviews" / label).mkdir(parents=True, exist_ok=True)
        (folder / "reviews" / label / f"{i}.txt").write_text(text, encoding="utf-8")


@pytest.mark.slow
def test_the_readmes_own_data_commands_run_as_written_after_its_set_up(tmp_path):
    from helpers import make_texts

    setup, *commands = _own_data_block()
    assert setup == "source .venv/bin/activate" and len(commands) == 3
    # the environment `make` made (in a checkout set up otherwise, the one these tests run in)
    venv = REPO / ".venv" if (REPO / ".venv" / "bin" / "activate").is_file() else Path(sys.prefix)
    if not (venv / "bin" / "activate").is_file():
        pytest.skip(f"the tests run outside a virtual environment ({sys.prefix}); the README's set-up makes one")
    env = {k: v for k, v in offline_env().items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(venv)))
    for i, command in enumerate(commands):
        work = tmp_path / f"user{i}"  # each command is an alternative, run where a user would: beside the data
        work.mkdir()
        (work / ".venv").symlink_to(venv)
        _write_reviews(work, make_texts(40, seed=i))
        proc = subprocess.run(["bash", "-c", f"{setup} && {command}"], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        metrics = json.loads((work / "outputs" / "reviews" / "metrics.json").read_text())
        assert metrics["labels"] == ["ham", "spam"] and metrics["train"]["updates"] == 2, command
