"""The package's shape: no import cycles, inference apart from training, docs whose links resolve."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = REPO / "finetune"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The finetune modules ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from finetune.metrics import _classification` imports a submodule when there is one
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != "finetune":
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "metrics/" not in str(p.relative_to(PACKAGE))
             or p.parent == PACKAGE / "metrics"}
    known = set(files)
    return {name: _imports(path, known) - {name} for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "finetune.fitting" in graph and graph["finetune.fitting"]  # the graph was really read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# A module that imports most of the package has become the package: each phase imports what it uses.
MAX_IMPORTS = 12
MAX_LINES = 450
# Modules still over MAX_LINES, each a single phase: the loop, whose docstrings are the algorithm's
# documentation, and the schema, one documented field per key, which grows with every setting
# (docs/configuration.md is generated from it). Adding a module here is a decision, not a default.
LONG_MODULES = {"finetune.loop", "finetune.schema"}


def _lines(module: str) -> int:
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_imports_most_of_the_package():
    graph = import_graph()
    crowded = {name: len(deps) for name, deps in graph.items() if len(deps) > MAX_IMPORTS}
    assert not crowded, f"modules importing more than {MAX_IMPORTS} of the package's: {crowded}"
    assert max(len(deps) for deps in graph.values()) >= 8  # the count sees real imports


def test_modules_stay_short_enough_to_read():
    graph = import_graph()
    long = {name: _lines(name) for name in graph if _lines(name) > MAX_LINES and name not in LONG_MODULES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them by phase"
    assert all(_lines(name) > MAX_LINES for name in LONG_MODULES)  # a module that got shorter leaves the list


def _main_guard_comes_last(path: Path) -> bool:
    """A script's ``if __name__ == "__main__":`` runs when Python reaches it: whatever is defined after it is
    not defined yet when ``main()`` runs, which imports (what the tests do) never show."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    guards = [i for i, node in enumerate(body)
              if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"]
    return all(i == len(body) - 1 for i in guards)


def test_a_script_defines_everything_before_it_runs():
    scripts = [p for folder in ("finetune", "bench", "tests") for p in sorted((REPO / folder).rglob("*.py"))
               if "__main__" in p.read_text(encoding="utf-8")]
    assert len(scripts) >= 15  # the check reads real scripts
    late = [str(p.relative_to(REPO)) for p in scripts if not _main_guard_comes_last(p)]
    assert not late, f"definitions after the `if __name__ == '__main__':` block, undefined when it runs: {late}"


def test_the_main_guard_check_sees_a_late_definition(tmp_path):
    script = tmp_path / "arm.py"
    script.write_text('def main():\n    helper()\n\n\nif __name__ == "__main__":\n    main()\n\n\ndef helper():\n    pass\n')
    assert not _main_guard_comes_last(script)
    script.write_text('def main():\n    pass\n\n\nif __name__ == "__main__":\n    main()\n')
    assert _main_guard_comes_last(script)


def _oldest_python() -> str:
    """The oldest Python that pyproject.toml's ``requires-python`` admits, e.g. ``3.10``."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^requires-python = ">=(\d+\.\d+)"$', text, re.MULTILINE).group(1)


def _needs_a_newer_python(*paths: Path) -> subprocess.CompletedProcess:
    """vermin's reading of ``paths`` against the oldest Python the package claims: what it uses of a newer
    standard library or syntax (``tomllib``, ``except*``), which no test run on a newer Python would notice."""
    vermin = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())"]  # it has no __main__
    return subprocess.run([*vermin, "--no-tips", "--violations", "--eval-annotations", f"-t={_oldest_python()}-",
                           *map(str, paths)], capture_output=True, text=True, timeout=300)


def test_the_code_needs_nothing_newer_than_the_oldest_python_it_claims():
    found = _needs_a_newer_python(REPO / "finetune", REPO / "bench", REPO / "tests")
    assert found.returncode == 0, found.stdout + found.stderr


def test_the_python_check_sees_a_newer_module_and_syntax(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import tomllib\n")
    found = _needs_a_newer_python(module)
    assert found.returncode == 1 and "'tomllib' module requires" in found.stdout
    syntax = tmp_path / "syntax.py"
    syntax.write_text("try:\n    pass\nexcept* ValueError:\n    pass\n")
    if sys.version_info < (3, 11):
        # vermin reads syntax with the running Python's parser; on a Python that old the parser itself refuses
        # it, and so would this run's imports
        with pytest.raises(SyntaxError):
            compile(syntax.read_text(), str(syntax), "exec")
        return
    found = _needs_a_newer_python(syntax)
    assert found.returncode == 1 and "`except*` requires" in found.stdout


def test_each_decision_has_the_file_the_readme_names():
    """The README's map says where each decision lives; the names it gives must exist there."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    homes = {"dataloaders.py": "def balance_micro_batches", "accumulation.py": "def resolve_batching",
             "optimization.py": "def plan_updates", "fitting.py": "class EvaluationSchedule",
             "output_dir.py": "def output_lock", "checkpoint_files.py": "FORMAT_VERSION",
             "checkpointer.py": "class Checkpointer", "resuming.py": "def run_fingerprint"}
    for file, definition in homes.items():
        assert f"`{file}`" in readme, file
        assert definition in (PACKAGE / file).read_text(encoding="utf-8"), (file, definition)


def test_a_cycle_would_be_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


TRAINING_SIDE = {"finetune.assembly", "finetune.fitting", "finetune.dataloaders", "finetune.output_dir",
                 "finetune.results", "finetune.runner", "finetune.loop", "finetune.checkpoint",
                 "finetune.checkpointer", "finetune.rehearsal", "finetune.checkpoint_files", "finetune.resuming", "finetune.cpu",
                 "finetune.signals", "finetune.accumulation", "finetune.optimization", "finetune.autobatch",
                 "finetune.sampling", "finetune.run"}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("module", ["finetune.predict", "finetune.score", "finetune.plot"])
def test_inference_reaches_nothing_of_the_training_side(module):
    graph = import_graph()
    assert not _reachable(graph, module) & TRAINING_SIDE


def test_importing_predict_loads_neither_the_runner_nor_the_loop():
    code = ("import sys, finetune.predict, finetune.score; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('finetune'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=REPO).stdout.split())
    assert "finetune.predict" in loaded
    assert not loaded & TRAINING_SIDE


# --------------------------------------------------------------------------- docs

DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings, and those its ``<a id="...">`` tags name."""
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
        anchors.update(re.findall(r'<a id="([\w-]+)"></a>', line))
    return anchors


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    return LINK.findall(text)


def test_docs_exist_and_the_readme_is_a_front_page():
    assert {p.name for p in (REPO / "docs").glob("*.md")} >= {
        "accumulation.md", "configuration.md", "errors.md", "checkpoints.md", "logging.md", "performance.md"}
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert "../shared" not in readme


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_inside_the_repository(doc):
    for link in _links(doc):
        if re.match(r"^[a-z]+:", link):
            continue  # a web address
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: {link}: no such file"
        assert REPO in path.parents or path == REPO, f"{doc.name}: {link}: outside the repository"
        if anchor:
            assert anchor in _anchors(path), f"{doc.name}: {link}: no heading for #{anchor} in {path.name}"


def test_every_docs_section_the_code_names_is_there():
    """A message's pointer (``docs/sweeps.md#several-workers``) is a link the user follows by hand: a heading
    renamed would leave it pointing nowhere, which no Markdown link check sees."""
    named = {(match.group(1), match.group(2))
             for folder in ("finetune", "bench") for path in sorted((REPO / folder).rglob("*.py"))
             for match in re.finditer(r"docs/([\w]+\.md)#([\w-]+)", path.read_text(encoding="utf-8"))}
    assert len(named) >= 8  # the pattern finds the messages' pointers
    missing = [f"docs/{doc}#{anchor}" for doc, anchor in sorted(named)
               if not (REPO / "docs" / doc).exists() or anchor not in _anchors(REPO / "docs" / doc)]
    assert not missing, f"sections the code names that the docs lack: {missing}"


def test_the_link_check_catches_a_broken_link(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n\nsee [this](#title) and [that](missing.md)\n", encoding="utf-8")
    assert _links(doc) == ["#title", "missing.md"]
    assert "title" in _anchors(doc)
    assert not (tmp_path / "missing.md").exists()


def _python_blocks(doc: Path) -> list[str]:
    """A Markdown file's ``python`` blocks, or a notebook's code cells (without their ``%`` magics)."""
    if doc.suffix == ".ipynb":
        import json

        cells = json.loads(doc.read_text(encoding="utf-8"))["cells"]
        return ["".join(line for line in cell["source"] if not line.startswith("%"))
                for cell in cells if cell["cell_type"] == "code"]
    return re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)


def _api_errors(code: str) -> list[str]:
    """What a docs snippet asks of the package that it lacks: a name imported from ``finetune`` that no module
    gives, an attribute of ``run`` that :class:`~finetune.run.Run` has no field or method for, a keyword
    that ``train_one_epoch`` or ``loop_settings`` does not take."""
    import dataclasses
    import importlib
    import inspect

    from finetune.loop import train_one_epoch
    from finetune.run import Run

    run_names = {f.name for f in dataclasses.fields(Run)} | {n for n in dir(Run) if not n.startswith("_")}
    takes = {"train_one_epoch": set(inspect.signature(train_one_epoch).parameters),
             "loop_settings": _loop_setting_names()}
    errors = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "finetune":
            module = importlib.import_module(node.module)
            errors += [f"from {node.module} import {a.name}: no such name" for a in node.names
                       if not hasattr(module, a.name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "run":
            if node.attr not in run_names:
                errors.append(f"run.{node.attr}: Run has no such field or method")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            errors += [f"{name}({k.arg}=...): no such argument" for k in node.keywords
                       if name in takes and k.arg is not None and k.arg not in takes[name]]
    return errors


def _loop_setting_names() -> set[str]:
    from finetune.run import Run
    from finetune.config import load_config
    from finetune.tasks import Task

    built = dict.fromkeys(["accelerator", "batching", "tokenizer", "labels", "model", "optimizer", "scheduler",
                           "train_dataloader", "eval_dataloader", "metrics", "plan"])
    return set(Run(cfg=load_config(None, []), task=Task(), **built).loop_settings())


@pytest.mark.parametrize("doc", [d for d in DOCS if _python_blocks(d)] + sorted((REPO / "notebooks").glob("*.ipynb")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_the_docs_python_asks_only_for_what_the_package_has(doc):
    for code in _python_blocks(doc):
        assert _api_errors(code) == [], f"{doc.name}: {code[:200]}"


def test_the_docs_python_check_catches_a_missing_name_field_and_argument():
    code = ("from finetune import setup_run, train_the_model\nrun = setup_run(cfg)\nrun.modle.eval()\n"
            "train_one_epoch(run.model, state=run.state, loss=f, **run.loop_settings(log_every=2))\n")
    assert sorted(_api_errors(code)) == ["from finetune import train_the_model: no such name",
                                         "loop_settings(log_every=...): no such argument",
                                         "run.modle: Run has no such field or method",
                                         "train_one_epoch(loss=...): no such argument"]


def test_the_files_the_suite_hands_out_first_exist():
    from conftest import LONGEST_FIRST

    # a renamed file would silently fall back to the end of the order
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [name for name in LONGEST_FIRST if not (REPO / "tests" / name).is_file()] == []
