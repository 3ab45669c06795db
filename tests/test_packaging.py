"""The wheel: ``pip install .`` (not editable) carries the configs, and the default run works from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

from helpers import REPO, offline_env


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
    env = offline_env({"PYTHONPATH": "", "FINETUNE_CPU_THREADS": "2"})
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
