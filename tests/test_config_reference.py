"""The configuration is documented once, on the schema's fields: the docs page and ``--help`` are generated."""

from __future__ import annotations

import dataclasses

import pytest

from finetune import config_reference
from finetune.config_reference import BEGIN, DOC, END, key_help, reference_markdown, with_reference
from finetune.schema import SECTIONS, TrainingConfig
from finetune.train import main as train_main


def _keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def test_every_key_has_its_help_on_its_field():
    undocumented = [key for key in _keys() if not _field(key).metadata.get("help", "").strip()]
    assert not undocumented


def _field(key: str) -> dataclasses.Field:
    section, name = key.split(".")
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)


def test_the_docs_page_holds_the_reference_the_schema_renders():
    page = DOC.read_text(encoding="utf-8")
    assert with_reference(page) == page, "run python -m finetune.config_reference --write"
    generated = page.split(BEGIN, 1)[1].split(END, 1)[0]
    for key in _keys():  # a row per key, under its section's table
        section, name = key.split(".")
        table = generated.split(f"### `{section}`", 1)[1].split("### ", 1)[0]
        assert f"| `{name}` |" in table, key


def test_a_changed_help_text_makes_the_page_stale(monkeypatch):
    page = DOC.read_text(encoding="utf-8")
    field = next(f for f in dataclasses.fields(TrainingConfig) if f.name == "seed")
    monkeypatch.setattr(field, "metadata", {"help": "A new explanation of the seed."})
    assert "A new explanation of the seed." in reference_markdown()
    assert with_reference(page) != page
    assert config_reference.main(["--check"]) == 1


def test_the_tables_say_type_and_default_as_yaml_writes_them():
    table = config_reference.section_table("training")
    assert "| `per_device_train_batch_size` | int or 'auto' | `32` |" in table
    assert "| `max_grad_norm` | float or null | `1.0` |" in table
    assert "| `eval_each_epoch` | bool | `true` |" in table
    assert "| `metrics` | list of str | `[accuracy, f1]` |" in config_reference.section_table("evaluation")


def test_train_help_lists_every_key_of_the_schema(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    listed = out.split("config keys, by section", 1)[1].split("examples:", 1)[0].splitlines()[1:]
    by_section, section = {}, None
    for line in listed:
        if line[2:3].strip():  # "  data        dataset_name, ..." opens a section; continuations are indented more
            section = line.split()[0]
        if section is not None:
            by_section.setdefault(section, []).extend(k.strip() for k in line[14:].split(",") if k.strip())
    assert by_section == {s: [f.name for f in dataclasses.fields(cls)] for s, cls in SECTIONS.items()}


def test_explain_prints_one_key_and_refuses_an_unknown_one(capsys):
    assert train_main(["--explain", "training.effective_batch_size"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("training.effective_batch_size: int or null (default: null)")
    assert "derived" in out
    assert key_help("optim.learning_rate").startswith("optim.learning_rate: float (default: 5e-05)")
    assert train_main(["--explain", "training.learning_rate"]) == 2
    assert "no such config key (did you mean optim.learning_rate?)" in capsys.readouterr().err


def test_the_trainer_guide_maps_real_trainer_arguments_to_real_keys():
    # docs/trainer.md's table: the left column's names are fields of the installed TrainingArguments (or
    # EarlyStoppingCallback's arguments), the middle column's are keys of the schema. The guide names
    # transformers 5's arguments (4.x had group_by_length and warmup_ratio for two of them).
    import inspect
    import re

    import transformers
    from transformers import EarlyStoppingCallback, TrainingArguments

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("docs/trainer.md names transformers 5's TrainingArguments")

    page = (DOC.parent / "trainer.md").read_text(encoding="utf-8")
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| `") and "`TrainingArguments`" not in line]
    trainer_names = {f.name for f in dataclasses.fields(TrainingArguments)}
    trainer_names |= set(inspect.signature(EarlyStoppingCallback.__init__).parameters)
    ours = set(_keys())
    assert len(rows) >= 25
    for row in rows:
        theirs = re.findall(r"`([a-z_0-9]+)`", row[0].strip("| "))
        keys = re.findall(r"`([a-z_]+\.[a-z_0-9]+)`", row[1])
        assert theirs and keys, row
        assert set(theirs) <= trainer_names | {"EarlyStoppingCallback"}, (row[0], set(theirs) - trainer_names)
        assert set(keys) <= ours, (row[1], set(keys) - ours)
    prose = re.findall(r"`(model\.[a-z_]+)`", page)
    assert prose and set(prose) <= ours
    # the errors' hints for the Trainer's names (finetune.key_hints.TRAINER_NAMES) say what this table says: every
    # name that is no key of ours has its hint, and the hint is a key of its row
    from finetune.key_hints import TRAINER_NAMES

    our_names = {key.split(".")[1] for key in ours}
    table = {name: re.findall(r"`([a-z_]+\.[a-z_0-9]+)`", row[1]) for row in rows
             for name in re.findall(r"`([a-z_0-9]+)`", row[0].strip("| ")) if name != "EarlyStoppingCallback"}
    assert set(TRAINER_NAMES) == {name for name in table if name not in our_names}
    for name, key in TRAINER_NAMES.items():
        assert key in table[name], (name, key, table[name])
