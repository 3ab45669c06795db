"""Every shipped config loads, validates, documents each key, and says how to run it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from finetune.config import load_config
from finetune.resources import is_package_path, resolve_package_path

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "bbc_news.yaml", "bert_base_sst2.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.output.output_dir
    # offline configs point at files that really are installed
    for spec in (cfg.model.name_or_path, cfg.data.train_file):
        if spec and is_package_path(spec):
            assert resolve_package_path(spec).exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_documented(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    assert re.match(rf"# Run: accelerate launch finetune/train.py --config configs/{path.name}$", lines[0])
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if line.startswith(" "):  # a key inside a section
            assert " # " in line, f"{path.name}:{number}: key without a comment: {line!r}"
