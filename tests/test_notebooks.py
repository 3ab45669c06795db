"""The notebooks run top to bottom (nbclient) on a tiny model and data set, through their parameter cell.

Like papermill, the test inserts a cell after the one tagged ``parameters``
that overrides its values; a last injected cell prints the kernel's results as
JSON so the test can check what the notebook computed, not only that it ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import forked
from helpers import REPO, make_texts, offline_env, run_cli, save_tiny_model, tsv_train_file, write_tsv

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = REPO / "notebooks"
RESULT_MARK = "RESULT_JSON="


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("nb_assets")
    return save_tiny_model(root / "tiny-bert"), write_tsv(root / "sms.tsv", make_texts(120, seed=3))


def _tiny_overrides(model: Path, data: Path) -> list[str]:
    return [
        f"model.name_or_path={model}",
        tsv_train_file(data),
        "data.max_length=32",
        "evaluation.metrics=[accuracy,f1]",
        "logging.progress_bar=false",
    ]


def execute(name: str, parameters: str, report: str, timeout: int = 240):
    """Run notebook ``name`` with ``parameters`` injected; returns (notebook, the dict ``report`` printed)."""
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{name}: needs exactly one cell tagged 'parameters'"
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(parameters))
    nb.cells.append(nbformat.v4.new_code_cell(f"import json\nprint({RESULT_MARK!r} + json.dumps({report}))"))
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    saved = dict(os.environ)
    # the kernel inherits this environment; one thread: a 32-wide model gains nothing from two on a busy CPU
    os.environ.update(offline_env({"FINETUNE_CPU_THREADS": "1"}))
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    line = next(x for x in text.splitlines() if x.startswith(RESULT_MARK))
    return nb, json.loads(line[len(RESULT_MARK):])


@pytest.mark.parametrize("name", ["quickstart.ipynb", "accumulation.ipynb"])
def test_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: stored with outputs"


def test_importing_finetune_touches_no_device():
    """What notebook_launcher needs: importing every module creates no Accelerate state and no CUDA context."""
    code = (
        "import importlib, pkgutil, finetune, torch\n"
        "from accelerate.state import PartialState, is_initialized\n"
        "names = [m.name for m in pkgutil.walk_packages(finetune.__path__, 'finetune.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "assert 'finetune.train' in names and 'finetune.predict' in names, names\n"
        "assert not is_initialized() and PartialState._shared_state == {}, 'Accelerate state created on import'\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=offline_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_quickstart(assets, tmp_path):
    model, data = assets
    overrides = _tiny_overrides(model, data) + [
        "training.per_device_train_batch_size=8", "training.effective_batch_size=16", "training.num_train_epochs=2",
        "evaluation.average=binary", "evaluation.positive_label=spam", f"output.output_dir={tmp_path / 'out'}",
        # fp32 on any CPU: the prepared model (under bf16 autocast where auto picks it) and the saved one
        # are compared at float rounding below
        "training.mixed_precision=no",
    ]
    parameters = (f"OVERRIDES = {overrides!r}\nTEXTS = ['free cash prize call now', 'see you at dinner tonight']\n"
                  f"LAUNCH_PROCESSES = 1\nLAUNCH_OUTPUT_DIR = {str(tmp_path / 'launched')!r}")
    nb, result = execute("quickstart.ipynb", parameters,
                         "{'records': records, 'updates': run.plan.total_updates, 'labels': list(run.labels.names), "
                         "'pipeline': classifier(TEXTS), 'predicted': predictor.predict(TEXTS), "
                         "'speedups': speedups.describe()}")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # no bar that cannot draw here: tqdm's widget without ipywidgets warns "IProgress not found"
    assert not [o for o in outputs if "IProgress" in o.get("text", "")]
    # the curves were drawn inline
    assert any("image/png" in o.get("data", {}) for o in outputs)
    train = [r for r in result["records"] if "train/loss" in r]
    evals = [r for r in result["records"] if "eval/loss" in r]
    assert [r["step"] for r in train] == list(range(1, result["updates"] + 1))
    assert len(evals) == 2 and evals[-1]["step"] == result["updates"]
    # the epochs ran with fit's CPU speed-ups, as train.py's do, and the model came back whole (the predictor
    # below uses it, and agrees with the saved one)
    assert "embedding_grad=sparse" in result["speedups"] and "dropout_masks=fast" in result["speedups"]
    # the in-memory predictor and plain transformers.pipeline on the saved model agree, with the data's label names
    assert result["labels"] == ["ham", "spam"]
    for p, q in zip(result["predicted"], result["pipeline"]):
        assert p["label"] == q["label"] and p["score"] == pytest.approx(q["score"], rel=1e-5)
    # the notebook_launcher cell ran train_function (one process: in the kernel) through fit
    launched = tmp_path / "launched"
    assert (launched / "model.safetensors").is_file() and (launched / "curves.png").is_file()


@pytest.mark.slow
def test_accumulation(assets):
    model, data = assets
    # 76 samples, b=8: 10 micro-batches, the last of 4 samples; k=4: windows of 32, 32 and 12 samples
    overrides = _tiny_overrides(model, data) + ["data.max_train_samples=76", "model.dropout=0.0",
                                                "training.max_grad_norm=null", "training.num_train_epochs=2",
                                                "optim.learning_rate=1e-3"]
    nb, result = execute("accumulation.ipynb", f"OVERRIDES = {overrides!r}",
                         "{'big': big_records, 'exact': exact_records, 'exact_diff': exact_diff, "
                         "'textbook_diff': textbook_diff, 'ragged': ragged_updates}")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2
    assert result["ragged"] == [3, 6]
    assert len(result["exact_diff"]) == len(result["textbook_diff"]) == 6
    # (b=8, k=4) is the big batch to float rounding after every update, ragged windows included ...
    assert max(result["exact_diff"]) < 1e-5
    for rb, re in zip(result["big"], result["exact"]):
        assert re["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5)
    # ... the textbook recipe too on the full windows, but not from the first ragged window on
    assert max(result["textbook_diff"][:2]) < 1e-5
    assert min(result["textbook_diff"][2:]) > max(100 * max(result["exact_diff"]), 1e-6)


def test_the_documented_headless_run_has_its_command():
    # docs/notebooks.md: `jupyter nbconvert --to notebook --execute ...` with the test extras `make` installs
    import shutil

    assert shutil.which("jupyter-nbconvert", path=str(Path(sys.executable).parent)) is not None
    docs = (REPO / "docs" / "notebooks.md").read_text(encoding="utf-8")
    assert "jupyter nbconvert --to notebook --execute notebooks/accumulation.ipynb" in docs


def test_a_runs_loop_settings_are_its_configs_and_take_a_change(monkeypatch):
    import inspect

    from finetune.run import Run
    from finetune.config import load_config
    from finetune.loop import train_one_epoch
    from finetune.tasks import Task

    cfg = load_config(None, ["training.on_nonfinite=skip", "training.max_grad_norm=0.5", "training.max_skipped=3"])
    task = Task(label_smoothing=0.1)
    built = dict.fromkeys(["accelerator", "batching", "tokenizer", "labels", "model", "optimizer", "scheduler",
                           "train_dataloader", "eval_dataloader", "metrics"])
    run = Run(cfg=cfg, plan="the plan", task=task, **built)
    settings = run.loop_settings()
    assert set(settings) <= set(inspect.signature(train_one_epoch).parameters)
    assert settings["loss_fn"] == task.per_sample_loss  # the config's loss, not the problem type's plain one
    assert (settings["max_grad_norm"], settings["on_nonfinite"], settings["max_skipped"]) == (0.5, "skip", 3)
    assert (settings["plan"], settings["graphs"]) == ("the plan", None)

    def focal(logits, labels):
        return labels.float()

    assert run.loop_settings(loss_fn=focal)["loss_fn"] is focal
    with pytest.raises(TypeError, match="'log_every' is not one of them"):
        run.loop_settings(log_every=2)  # a train_one_epoch argument of its own, not a setting of the run

    # with CUDA graphs built (run.speedups, on one GPU), a replayed micro-batch computes the loss they captured:
    # another loss has graphs of its own built, once, and the plain loss runs eagerly
    built_for = []
    monkeypatch.setattr("finetune.run.graphs_for_run",
                        lambda run, loss_fn=None: built_for.append(loss_fn) or types.SimpleNamespace(loss_fn=loss_fn))
    config_graphs = run.graphs = types.SimpleNamespace(loss_fn=task.per_sample_loss)
    assert run.loop_settings()["graphs"] is config_graphs and not built_for
    focal_settings = run.loop_settings(loss_fn=focal)
    assert focal_settings["loss_fn"] is focal and focal_settings["graphs"].loss_fn is focal and built_for == [focal]
    assert run.loop_settings(loss_fn=focal)["graphs"] is focal_settings["graphs"] is run.graphs
    assert built_for == [focal]  # kept, not captured again
    plain = run.loop_settings(loss_fn=None)
    assert plain["loss_fn"] is None and plain["graphs"] is None and run.graphs is focal_settings["graphs"]
    assert run.loop_settings(graphs=None, loss_fn=task.per_sample_loss)["graphs"] is None  # eager, as asked
    assert built_for == [focal]


def test_a_runs_epochs_set_each_epochs_k_and_end_with_the_plans_updates():
    """``for epoch in run.epochs()`` is fit's epoch loop: from the state's epoch (a resumed run's), each at the
    ``k`` its accumulation schedule gives it, and no epoch once the plan's updates are made."""
    from finetune.accumulation import AccumulationSchedule, Batching
    from finetune.config import load_config
    from finetune.loop import TrainState
    from finetune.run import Run

    schedule = AccumulationSchedule.from_dict({0: 4, 2: 2})
    batching = Batching(per_device_batch_size=8, gradient_accumulation_steps=4, num_processes=1, schedule=schedule)
    built = dict.fromkeys(["tokenizer", "labels", "model", "optimizer", "scheduler", "train_dataloader",
                           "eval_dataloader", "metrics"])

    def epochs_run(state: TrainState, updates_per_epoch: int, total_updates: int) -> list[tuple[int, int]]:
        accelerator = types.SimpleNamespace(gradient_accumulation_steps=1)
        plan = types.SimpleNamespace(num_epochs=4, total_updates=total_updates)
        run = Run(cfg=load_config(None, []), accelerator=accelerator, batching=batching, plan=plan, state=state,
                  **built)
        seen = []
        for epoch in run.epochs():
            seen.append((epoch, accelerator.gradient_accumulation_steps))
            state.step += updates_per_epoch  # what train_one_epoch would count
        return seen

    assert epochs_run(TrainState(), 3, 12) == [(0, 4), (1, 4), (2, 2), (3, 2)]
    assert epochs_run(TrainState(epoch=1, step=4), 3, 12) == [(1, 4), (2, 2), (3, 2)]  # resumed in epoch 1
    assert epochs_run(TrainState(), 5, 12) == [(0, 4), (1, 4), (2, 2)]  # training.max_steps: ended in epoch 2
    assert epochs_run(TrainState(epoch=3, step=12), 3, 12) == []  # every update made: nothing to train


def test_evaluating_a_run_without_validation_data_says_so():
    from finetune import evaluate_model

    with pytest.raises(ValueError, match=r"^evaluate_model: no dataloader to evaluate; a run without validation "
                                         r"data \(data.validation_split=0 and no validation file\) has none$"):
        evaluate_model(model=None, dataloader=None, accelerator=None)


@pytest.mark.slow
def test_the_readmes_notebook_code_trains_what_finetune_train_trains(assets, tmp_path):
    """README's "From a notebook" block, run as it stands in a fresh Python from the repository, with the tiny
    model and data added to its overrides: two epochs, each update logged through ``on_log``, each epoch
    evaluated. With class weights, label smoothing and an accumulation schedule in the config, its updates'
    losses are those of ``finetune train`` on the same config: a loop that dropped the config's loss would train
    another model, and one that kept epoch 0's ``k`` would stop at epoch 1."""
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    code = re.search(r"## From a notebook.*?```python\n(.*?)```", readme, re.S).group(1)
    given = '["training.num_train_epochs=2"]'
    assert given in code  # the block's own overrides, which the tiny run extends
    tiny = [*_tiny_overrides(*assets), "training.class_weights=balanced", "training.label_smoothing=0.2",
            "training.accumulation_schedule={1: 2}"]
    overrides = ["training.num_train_epochs=2", *tiny]
    code = code.replace(given, json.dumps([*overrides, f"output.output_dir={tmp_path / 'notebook'}"]))
    env = offline_env({"FINETUNE_CPU_THREADS": "1"})
    proc = forked.run([sys.executable, "-c", code], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    epochs = [line for line in lines if line.startswith(("0 ", "1 ")) and "{" in line]
    assert [line.split()[0] for line in epochs] == ["0", "1"]
    assert all("'accuracy':" in line and "'f1':" in line for line in epochs)
    losses = {int(line.split()[0]): float(line.split()[1]) for line in lines if "{" not in line}
    assert sorted(losses) == list(range(1, len(losses) + 1)) and len(losses) >= 4  # every update, over both epochs

    cli = tmp_path / "cli"
    done = run_cli(["--config", str(REPO / "configs" / "default.yaml"), *overrides, f"output.output_dir={cli}"],
                   env={"FINETUNE_CPU_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (cli / "train_log.jsonl").read_text().splitlines()]
    trained = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    assert sorted(trained) == sorted(losses)
    for step, loss in trained.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
