"""tests/mutants.py, the deliberate bugs the tests of the package's promises must catch, kept in step with the
code."""

from __future__ import annotations

from pathlib import Path

import pytest

import mutants  # tests/ is on the path, as for helpers

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("number", range(len(mutants.MUTANTS)))
def test_each_mutant_changes_one_line_the_code_still_has_and_names_tests_that_exist(number):
    mutant = mutants.MUTANTS[number]
    text = mutants.source_of(mutant)  # raises where the line moved or repeats
    assert mutant.bug != mutant.line and text.replace(mutant.line, mutant.bug) != text
    assert mutant.tests and all((REPO / name).is_file() for name in mutant.tests)


def test_a_line_the_code_no_longer_has_is_named(tmp_path):
    (tmp_path / "finetune").mkdir()
    (tmp_path / "finetune" / "loop.py").write_text("x = 1\n", encoding="utf-8")
    moved = mutants.Mutant("loop.py", "y = 2", "y = 3", "a rule", ("tests/test_accumulation.py",))
    with pytest.raises(ValueError, match=r"finetune/loop.py: 'y = 2' occurs 0 times, not once: update the mutant"):
        mutants.source_of(moved, tmp_path)


def test_several_sets_are_listed_together_and_an_unknown_one_is_named(capsys):
    assert mutants.main(["--rules", "long_texts,inference", "--list"]) == 0
    listed = [int(line.split()[0]) for line in capsys.readouterr().out.splitlines()]
    sets = mutants.LONG_TEXT_MUTANTS + mutants.INFERENCE_MUTANTS
    assert listed == [i for i, m in enumerate(mutants.MUTANTS) if m in sets] and len(listed) == len(sets)
    with pytest.raises(SystemExit) as stopped:
        mutants.main(["--rules", "memory,speed", "--list"])
    assert stopped.value.code == 2
    assert "--rules: no set 'speed' (the sets: accumulation, resume, input" in capsys.readouterr().err


@pytest.mark.slow
def test_a_mutant_is_caught_in_a_copy_and_the_checkout_is_left_as_it_was(tmp_path):
    """The check runs the mutant's tests on a scratch copy: they fail there, and the package here is unchanged."""
    mutant = next(m for m in mutants.MUTANTS if m.tests == ("tests/test_accumulation_schedule.py",))
    before = (REPO / "finetune" / mutant.module).read_text(encoding="utf-8")
    copy = mutants.scratch_copy(tmp_path)
    caught, summary = mutants.killed(mutant, copy)
    assert caught and "failed" in summary
    assert (copy / "finetune" / mutant.module).read_text(encoding="utf-8") == before  # put back in the copy too
    assert (REPO / "finetune" / mutant.module).read_text(encoding="utf-8") == before
