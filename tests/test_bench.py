"""The benchmark's machinery on a tiny BERT: each arm trains the asked updates and counts what it trained.

Not a performance test: no timing is asserted. It keeps ``bench/`` working
(arms, the package's CLI under the memory probe, aggregation, the report).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import REPO, compiling_with, make_texts, save_tiny_model, tsv_train_file, write_tsv

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench/ is not part of the installed package

from bench.common import ArmSpec  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model = save_tiny_model(root / "tiny-bert")
    data = write_tsv(root / "sms.csv", make_texts(80, seed=5))
    # the default (SMS) job's config, pointed at the tiny model and data
    return [f"model.name_or_path={model}", tsv_train_file(data), "data.max_length=32",
            "training.per_device_eval_batch_size=16"]


def _check(result, updates, samples):
    assert result["updates"] == updates
    # exactly the samples of the updates made: not the batch the dataloader collated ahead
    assert result["samples"] == samples
    assert 2 * samples <= result["tokens"] <= 32 * samples
    assert result["train_seconds"] > 0
    assert set(result["eval"]) >= {"accuracy", "f1"}
    assert result["rss_peak_mib"] > 10


def test_peer_arms_score_the_f1_the_package_scores(tiny_job):
    """``average: auto`` is the package's decision in every arm: the binary F1 of the rarer class, not macro."""
    from bench.common import job_config, load_job

    cfg = job_config(ArmSpec("trainer", "sms", b=4, k=2, max_steps=2, overrides=tiny_job, threads=1))
    _, tokenized, labels, _, metrics = load_job(cfg)
    assert metrics.average == "binary" and labels.names[metrics.pos_label] == "spam"  # 30% of the tiny set
    # binary and macro F1 differ on the same predictions: the arms would not be compared on one metric
    predictions = [0, 1, 1, 0, 0, 0]
    references = [0, 1, 0, 0, 0, 1]
    spam = labels.names.index("spam")
    flip = (lambda x: x) if spam == 1 else (lambda x: 1 - x)
    scores = metrics.compute([flip(p) for p in predictions], [flip(r) for r in references])
    assert scores["f1"] == pytest.approx(0.5)  # spam: one hit, one miss, one false alarm


def test_peer_arms_train_and_count(tiny_job, fresh_accelerate_state):
    from bench import arm_accelerate, arm_trainer

    spec = ArmSpec("trainer", "sms", b=4, k=2, max_steps=2, overrides=tiny_job, threads=1)
    for result in (arm_trainer.run(spec), arm_accelerate.run(ArmSpec(**{**spec.__dict__, "arm": "accelerate"}))):
        _check(result, updates=2, samples=16)
        # each update timed, from the training's start: their sum is the training's time, to the last update's end
        assert len(result["update_seconds"]) == 2 and all(t > 0 for t in result["update_seconds"])
        assert sum(result["update_seconds"]) <= result["train_seconds"] < sum(result["update_seconds"]) + 0.5


def test_package_arm_and_report(tiny_job, tmp_path):
    from bench.run import Job, Settings, aggregate, markdown, run_job

    settings = Settings(out=tmp_path, repeats=1, threads=1, precision="no", smoke=True, sms_steps=2, bbc_steps=1,
                        datasets=["sms"])
    job = Job("sms/ours", ArmSpec("ours", "sms", b=4, k=2, max_steps=2, overrides=tiny_job, threads=1),
              label="finetune")
    result = run_job(job, settings, 1)
    assert result["ok"], result
    _check(result, updates=2, samples=16)
    assert len(result["update_seconds"]) == 2

    # the Trainer row is the reference of the ratios: a made-up one at half the speed and twice the memory
    trainer = {**result, "job": "sms/trainer", "train_seconds": 2 * result["train_seconds"],
               "rss_peak_mib": 2 * result["rss_peak_mib"], "eval": {"accuracy": 0.5, "f1": 0.25}}
    jobs = [job, Job("sms/trainer", ArmSpec("trainer", "sms", 8, 1), label="Trainer")]
    rows = aggregate(jobs, [result, trainer], peak=None, fms={})
    assert rows["sms/ours"]["samples_per_s_x_trainer"] == pytest.approx(2.0)
    assert rows["sms/ours"]["memory_x_trainer"] == pytest.approx(0.5)
    assert rows["sms/ours"]["f1_minus_trainer_pt"] == pytest.approx(100 * (result["eval"]["f1"] - 0.25))
    report = {"machine": {"gpu": None, "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": rows, "results": [result, trainer], "smoke": True, "command": "bench", "precision": "no",
              "repeats": 1, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": None}
    row = next(line for line in markdown(report).splitlines() if line.startswith("| finetune |"))
    assert "| 2.00 |" in row and "| 0.50 |" in row  # x Trainer in speed and in memory


def test_the_package_arm_reads_its_engine_and_checkout_options(tmp_path):
    from bench.arm_ours import command

    plain = command(ArmSpec("ours", "bbc", 8, 4), tmp_path)
    assert "--config_file" not in plain and str(REPO / "finetune" / "train.py") in plain
    both = command(ArmSpec("ours", "bbc", 8, 4, options=["engine=fsdp", f"checkout={tmp_path}"]), tmp_path)
    assert both[both.index("--config_file") + 1] == str(REPO / "configs" / "accelerate" / "fsdp.yaml")
    assert str(tmp_path / "finetune" / "train.py") in both
    assert both[both.index("--config") + 1] == str(tmp_path / "configs" / "bbc_news.yaml")


def test_a_baseline_checkout_trains_its_own_package_in_the_same_rounds(tiny_job, tmp_path):
    """``--baseline``: a row trained by another checkout's package and configs (before and after, side by side).
    The copy here marks its own import, so the run shows which package it trained with."""
    import shutil

    from bench.run import Job, Settings, main_jobs, run_job

    before = tmp_path / "before"
    for folder in ("finetune", "configs"):
        shutil.copytree(REPO / folder, before / folder, ignore=shutil.ignore_patterns("__pycache__"))
    with open(before / "finetune" / "__init__.py", "a", encoding="utf-8") as init:
        init.write("\nimport os as _os\nif _os.environ.get('MARK'):\n"
                   "    open(_os.environ['MARK'], 'w').write(__file__)\n")
    settings = Settings(out=tmp_path / "out", repeats=1, threads=1, precision="no", smoke=True, sms_steps=2,
                        bbc_steps=1, datasets=["sms"], baseline=before)
    planned = {j.name: j for j in main_jobs(settings, trainer_k1=False)}
    assert planned["sms/ours baseline"].label == f"finetune at {before}, b=8 k=4"  # no git here to name a commit
    spec = planned["sms/ours baseline"].spec
    mark = tmp_path / "mark"
    spec = ArmSpec(**{**spec.__dict__, "b": 4, "k": 2, "max_steps": 2, "overrides": tiny_job,
                      "env": {"MARK": str(mark)}})
    result = run_job(Job("sms/ours baseline", spec, label="before"), settings, 1)
    assert result["ok"], result
    _check(result, updates=2, samples=16)
    assert mark.read_text() == str(before / "finetune" / "__init__.py")


def test_trainer_in_package_order_draws_the_package_sampler(tiny_job, tmp_path, fresh_accelerate_state):
    """The accuracy comparison's fourth arm: the Trainer's sampler yields exactly the package's training order."""
    from bench import arm_trainer
    from bench.common import job_config
    from finetune.assembly import setup_run

    spec = ArmSpec("trainer", "sms", b=8, k=1, overrides=tiny_job + [f"output.output_dir={tmp_path}"], threads=1,
                   options=["package_order"])
    cfg = job_config(spec)
    run = setup_run(cfg)
    package = list(run.train_dataloader.batch_sampler.sampler)
    lengths = [len(ids) for ids in run.train_dataloader.dataset["input_ids"]]
    trainer_class = arm_trainer.PackageOrderTrainer(cfg, spec, lengths)
    assert list(trainer_class._get_train_sampler(None)) == package  # (the method does not use self)
    other_seed = arm_trainer.PackageOrderTrainer(job_config(spec, ["training.seed=7"]), spec, lengths)
    assert list(other_seed._get_train_sampler(None)) != package
    # and the arm trains with it
    _check(arm_trainer.run(ArmSpec(**{**spec.__dict__, "max_steps": 2})), updates=2, samples=16)


def test_accuracy_rows_pair_seeds():
    """Accuracy runs of different seeds are averaged, and differences to the Trainer and the package paired by seed."""
    from bench.run import Job, aggregate, markdown

    def result(job, seed, f1, acc):
        return {"job": job, "seed": seed, "ok": True, "updates": 10, "samples": 320, "tokens": 3200,
                "train_seconds": 10.0, "eval": {"f1": f1, "accuracy": acc}}

    names = ["sms/ours accuracy", "sms/trainer accuracy", "sms/trainer accuracy, package order"]
    jobs = [Job(n, ArmSpec("ours", "sms", 16, 2), "accuracy", label=n) for n in names]
    results = [
        result(names[0], 42, 0.90, 0.98), result(names[0], 43, 0.96, 0.99),
        result(names[1], 42, 0.94, 0.985), result(names[1], 43, 0.95, 0.99),
        result(names[2], 42, 0.91, 0.98), result(names[2], 43, 0.96, 0.99),
        result(names[1], 44, 0.50, 0.5),  # a seed the package did not finish: not paired
    ]
    rows = aggregate(jobs, results, peak=None, fms={})
    ours = rows["sms/ours accuracy"]
    assert ours["eval"]["f1"] == pytest.approx(0.93)  # the mean of the seeds, not a median
    assert ours["f1_minus_trainer_pt_by_seed"] == pytest.approx({"42": -4.0, "43": 1.0})
    assert ours["f1_minus_trainer_pt"] == pytest.approx(-1.5)
    same_order = rows["sms/trainer accuracy, package order"]
    assert same_order["f1_minus_ours_pt_by_seed"] == pytest.approx({"42": 1.0, "43": 0.0})
    assert same_order["f1_minus_ours_pt"] == pytest.approx(0.5)
    # without a Trainer row (--only "ours accuracy,package order") the pairing with the package still holds
    alone = aggregate([jobs[0], jobs[2]], [r for r in results if r["job"] != names[1]], peak=None, fms={})
    assert alone["sms/trainer accuracy, package order"]["f1_minus_ours_pt"] == pytest.approx(0.5)
    report = {"machine": {"gpu": None, "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": rows, "results": results, "smoke": False, "command": "bench", "precision": "no",
              "repeats": 1, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": None}
    text = markdown(report)
    assert "seeds 42, 43, 44" in text
    row = next(line for line in text.splitlines() if line.startswith("| sms/ours accuracy |"))
    assert "| 0.9000 / 0.9600 / n/a |" in row and "| -1.50 |" in row


def test_speed_ratios_pair_the_arms_of_each_round():
    """A machine that slows between rounds moves both arms of a round: the paired ratio sees through it."""
    from bench.run import Job, aggregate, markdown

    def result(job, rnd, samples_per_s):
        return {"job": job, "round": rnd, "seed": None, "ok": True, "updates": 4, "samples": 128, "tokens": 2560,
                "train_seconds": 128 / samples_per_s, "eval": {}}

    jobs = [Job("sms/ours", ArmSpec("ours", "sms", 8, 4), label="finetune"),
            Job("sms/trainer", ArmSpec("trainer", "sms", 8, 4), label="Trainer")]
    # round by round the package is 1.5x, 2.0x and 1.6x the Trainer, on a machine that halves its speed
    # after the first round; the medians over all rounds pair the package's round 2 with the Trainer's round 0
    results = [result("sms/ours", 0, 90.0), result("sms/trainer", 0, 60.0),
               result("sms/ours", 1, 60.0), result("sms/trainer", 1, 30.0),
               result("sms/ours", 2, 48.0), result("sms/trainer", 2, 30.0),
               {"job": "sms/ours", "round": 3, "seed": None, "ok": False, "error": "exit 1", "log_tail": ["x"]},
               result("sms/trainer", 3, 50.0)]  # the package's run of round 3 failed: that round pairs nothing
    rows = aggregate(jobs, results, peak=None, fms={})
    ours = rows["sms/ours"]
    assert ours["samples_per_s_x_trainer_by_round"] == pytest.approx([1.5, 2.0, 1.6])
    assert ours["samples_per_s_x_trainer_paired"] == pytest.approx(1.6)
    assert ours["samples_per_s_x_trainer"] == pytest.approx(60.0 / 40.0)  # the ratio of medians differs
    assert "samples_per_s_x_trainer_paired" not in rows["sms/trainer"]
    report = {"machine": {"gpu": None, "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": rows, "results": results, "smoke": False, "command": "bench", "precision": "no",
              "repeats": 3, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": None}
    assert "finetune 1.60 (median; rounds 1.50, 2.00, 1.60)" in markdown(report)


def _bench_stopped_in_its_run(tmp_path, monkeypatch, stop_at: int, repeats: int, arms: str) -> tuple[list, Path]:
    """``bench/run.py`` on the SMS job's ``arms``, each run faked (the package twice the others' speed), stopped
    as a lease's time limit stops it when the ``stop_at``-th run starts; the runs started, and the output
    folder."""
    from bench import run

    calls = []

    def fake_job(job, s, index):
        calls.append(job.name)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        speed = 100.0 if job.name == "sms/ours" else 50.0
        return {"job": job.name, "seed": None, "ok": True, "updates": 4, "samples": 128, "tokens": 2560,
                "train_seconds": 128 / speed, "wall_seconds": 1.0, "eval": {}}

    monkeypatch.setattr(run, "run_job", fake_job)
    monkeypatch.setattr(run, "run_helper", lambda *a, **k: None)
    monkeypatch.setattr(run, "flops_model", lambda dataset, s: None)
    out = tmp_path / "bench"
    with pytest.raises(KeyboardInterrupt):
        run.main(["--datasets", "sms", "--accuracy-seeds", "0", "--skip-grad-check", "--repeats", str(repeats),
                  "--only", arms, "--out", str(out)])
    return calls, out


def test_a_benchmark_stopped_mid_run_leaves_the_tables_of_its_finished_rounds(tmp_path, monkeypatch):
    """A run killed on a time limit (a GPU lease) keeps what it measured: the report is written after every
    round, says how many ran, and the arms' ratios pair the rounds that finished."""
    import json

    # the lease ends in the second round's first arm
    _, out = _bench_stopped_in_its_run(tmp_path, monkeypatch, stop_at=5, repeats=3,
                                       arms="=sms/ours,=sms/trainer,=sms/accelerate,bk1")
    report = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    assert report["rounds"] == {"done": 1, "planned": 3}
    assert len(report["results"]) == 3 and report["rows"]["sms/ours"]["samples_per_s_x_trainer_paired"] == 2.0
    assert "**Cut short:** 1 of 3 rounds ran" in (out / "bench.md").read_text(encoding="utf-8")


def test_a_single_round_stopped_in_its_third_arm_keeps_the_two_that_ran(tmp_path, monkeypatch):
    """The GPU check's compiled parts run one round of several arms; a time limit in the middle of it leaves the
    tables of the arms that finished, said to be cut, where before it left none."""
    import json

    calls, out = _bench_stopped_in_its_run(tmp_path, monkeypatch, stop_at=3, repeats=1,
                                           arms="=sms/ours,=sms/trainer,=sms/accelerate")
    report = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    assert report["rounds"] == {"done": 0, "planned": 1, "first_round_arms": 2, "arms": 3}
    assert [r["job"] for r in report["results"]] == calls[:2]
    ran = {name: row["repeats"] for name, row in report["rows"].items()}
    assert sorted(n for n, repeats in ran.items() if repeats) == sorted(calls[:2])
    assert "**Cut short:** the first round stopped after 2 of its 3 arms" in (out / "bench.md").read_text()


def test_a_gpu_table_shows_the_reserved_peak_that_counts_a_graph_pool():
    """On a GPU the speed table shows the reserved peak beside the allocated one (a CUDA graph's pool is only in
    the reserved), and the ratio to the Trainer stays on the allocated peak."""
    from bench.run import Job, aggregate, markdown

    def result(job, allocated, reserved):
        return {"job": job, "round": 0, "seed": None, "ok": True, "updates": 4, "samples": 128, "tokens": 2560,
                "train_seconds": 2.0, "eval": {}, "gpu_peak_mib": allocated, "gpu_reserved_peak_mib": reserved}

    jobs = [Job("bbc/ours graphs", ArmSpec("ours", "bbc", 64, 4), label="finetune cuda_graphs"),
            Job("bbc/trainer", ArmSpec("trainer", "bbc", 64, 4), label="Trainer")]
    rows = aggregate(jobs, [result("bbc/ours graphs", 3000.0, 5200.0), result("bbc/trainer", 4000.0, 4400.0)],
                     peak=None, fms={})
    assert rows["bbc/ours graphs"]["gpu_reserved_peak_mib"] == 5200.0
    assert rows["bbc/ours graphs"]["memory_x_trainer"] == pytest.approx(0.75)
    report = {"machine": {"gpu": "H100", "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": rows, "results": [], "smoke": False, "command": "bench", "precision": "bf16",
              "repeats": 1, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": None}
    lines = markdown(report).splitlines()
    header = next(line for line in lines if line.startswith("| arm |"))
    row = next(line for line in lines if line.startswith("| finetune cuda_graphs |"))
    assert header.split("|")[5:8] == [" GPU peak MiB ", " x Trainer ", " GPU reserved MiB "]
    assert row.split("|")[5:8] == [" 3000 ", " 0.75 ", " 5200 "]
    assert len(row.split("|")) == len(header.split("|"))


def test_a_run_whose_graphs_were_refused_is_named_under_the_speed_table():
    """A refused capture leaves a run eager from there (metrics.json's ``train.cuda_graphs.refused``): its rate
    alone would pass for the graphs', so the report names the arm and CUDA's reason."""
    from bench.run import Job, aggregate, markdown

    said = "the capture failed (CUDA error: operation not permitted when stream is capturing), so from here on"

    def result(job, refused):
        return {"job": job, "round": 0, "seed": None, "ok": True, "updates": 4, "samples": 128, "tokens": 2560,
                "train_seconds": 2.0, "eval": {}, "gpu_peak_mib": 3000.0, "gpu_reserved_peak_mib": 5000.0,
                "cuda_graphs": {"lengths": [128], "refused": refused}}

    jobs = [Job("bbc/ours", ArmSpec("ours", "bbc", 64, 4), label="finetune graphed"),
            Job("bbc/ours blocks", ArmSpec("ours", "bbc", 64, 4), label="finetune blocks"),
            Job("bbc/trainer", ArmSpec("trainer", "bbc", 64, 4), label="Trainer")]
    rows = aggregate(jobs, [result("bbc/ours", None), result("bbc/ours blocks", said),
                            {**result("bbc/trainer", None), "cuda_graphs": None}], peak=None, fms={})
    assert rows["bbc/ours blocks"]["graphs_refused"] == said
    assert "graphs_refused" not in rows["bbc/ours"] and "graphs_refused" not in rows["bbc/trainer"]
    report = {"machine": {"gpu": "H200", "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": rows, "results": [], "smoke": False, "command": "bench", "precision": "bf16",
              "repeats": 1, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": None}
    notes = [line for line in markdown(report).splitlines() if line.startswith("Replayed from CUDA graphs only")]
    assert notes == [f"Replayed from CUDA graphs only in part, the rest eagerly: finetune blocks: {said}."]


def test_the_machine_warm_up_trains_a_small_bert_and_the_report_says_how_long_it_took():
    """Before the first round (on a GPU) the peak helper runs a few real training steps, so that the first arm
    does not pay the machine's first load of CUDA's libraries; the report gives their time."""
    import torch

    from bench.peak import warm_up_kernels
    from bench.run import markdown

    warm = warm_up_kernels("bf16", torch.device("cpu"), layers=1, hidden=64)
    assert warm["warmup_weight_change"] > 0 and warm["warmup_seconds"] > 0  # the steps trained the weights
    peak = {"dtype": "bfloat16", "device": "H100", "peak_gflops": 7e5, "gflops_by_size": {}, **warm}
    report = {"machine": {"gpu": "H100", "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": {}, "results": [], "smoke": False, "command": "bench", "precision": "bf16",
              "repeats": 1, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": peak}
    said = [line for line in markdown(report).splitlines() if line.startswith("Before the first round")]
    assert said == [f"Before the first round the machine ran a small BERT's training steps in "
                    f"{warm['warmup_seconds']:.1f} s (bench/peak.py), so that no arm pays the machine's first load "
                    "of CUDA's libraries."]
    failed = {**report, "peak": {**peak, "warmup_error": "OutOfMemoryError: CUDA out of memory"}}
    failed["peak"].pop("warmup_seconds")
    assert "The machine's warm-up before the first round failed (OutOfMemoryError: CUDA out of memory): the first " \
           "arm may have paid the machine's first load of CUDA's libraries." in markdown(failed).splitlines()


def test_the_report_gives_each_arms_cold_start_steady_rate_and_the_run_length_where_it_beats_the_trainer():
    """10 updates of 256 samples each: the package starts 2.75 s slower than the Trainer and then takes 0.25 s less
    per update, so it is ahead from the 11th update on."""
    from bench.run import Job, aggregate, markdown, overtakes

    def result(job, seconds):
        return {"job": job, "round": 0, "seed": None, "ok": True, "updates": 10, "samples": 2560, "tokens": 25600,
                "train_seconds": sum(seconds), "eval": {}, "update_seconds": seconds}

    jobs = [Job("bbc/ours", ArmSpec("ours", "bbc", 64, 4), label="finetune"),
            Job("bbc/trainer", ArmSpec("trainer", "bbc", 64, 4), label="Trainer")]
    rows = aggregate(jobs, [result("bbc/ours", [2.0, 1.0, 0.5] + [0.25] * 7), result("bbc/trainer", [0.5] * 10)],
                     peak=None, fms={})
    ours, trainer = rows["bbc/ours"], rows["bbc/trainer"]
    assert ours["steady_update_seconds"] == 0.25 and ours["steady_samples_per_s"] == 1024
    assert ours["first_update_seconds"] == 2.0 and ours["cold_seconds"] == 2.75 and trainer["cold_seconds"] == 0
    assert overtakes(ours, trainer) == "after 11 updates"
    assert overtakes(trainer, ours) == "for the first 11 updates only"
    assert overtakes({**ours, "cold_seconds": -1.0}, trainer) == "from the first update"
    assert overtakes({**ours, "steady_update_seconds": 0.5}, trainer) == "never"
    report = {"machine": {"gpu": "H100", "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": rows, "results": [], "smoke": False, "command": "bench", "precision": "bf16",
              "repeats": 1, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": None}
    lines = markdown(report).splitlines()
    assert "| finetune | 2.000 | 0.2500 | 1024.0 | 2.00 | 2.75 | after 11 updates |" in lines
    assert "| Trainer | 0.500 | 0.5000 | 512.0 | 1.00 | 0.00 |  |" in lines

    # the levers' table reads the same two figures
    from bench.levers import summarize

    lever = summarize(jobs[:1], [{**result("bbc/ours", [2.0, 1.0, 0.5] + [0.25] * 7), "rss_peak_mib": 1.0}])
    assert (lever["bbc/ours"]["steady_update_seconds"], lever["bbc/ours"]["overhead_seconds"]) == (0.25, 2.75)


def test_the_accumulation_table_compares_b_k_with_b_1_without_the_big_batch_arm():
    """The GPU check runs (b, k) and (b, 1), not (b*k, 1): its peak memory target, (64, 4) against (64, 1), needs
    the table all the same."""
    from bench.run import Job, aggregate, markdown

    def result(job, seconds, peak):
        return {"job": job, "round": 0, "seed": None, "ok": True, "updates": 4, "samples": 256, "tokens": 2560,
                "train_seconds": seconds, "eval": {}, "gpu_peak_mib": peak, "gpu_reserved_peak_mib": peak}

    jobs = [Job("bbc/ours", ArmSpec("ours", "bbc", 64, 4), label="finetune"),
            Job("bbc/ours bk1", ArmSpec("ours", "bbc", 64, 1), "accumulation", "finetune, b=64 k=1")]
    rows = aggregate(jobs, [result("bbc/ours", 2.0, 5200.0), result("bbc/ours bk1", 2.5, 5000.0)],
                     peak=None, fms={})
    report = {"machine": {"gpu": "H100", "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                          "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"},
              "rows": rows, "results": [], "smoke": False, "command": "bench", "precision": "bf16",
              "repeats": 1, "wall_minutes": 0.1, "trainer_grad_check": None, "peak": None,
              "batching": {"bbc": [64, 4]}}
    lines = markdown(report).splitlines()
    table = lines[lines.index("## Accumulation: time and memory (package CLI, BBC News, same samples)") + 2:]
    assert table[2] == "| b=64, k=4 (B=256) | 128.0 | 1.250 | 5200 | 1.040 |"
    assert table[3] == "| b=64, k=1 (B=64) | 102.4 | 1.000 | 5000 | 1.000 |"
    assert table[4] == ""


def test_the_gpu_check_runs_the_parts_asked_for_and_goes_on_past_a_failing_one(tmp_path):
    """bench/gpu.sh's plumbing, with a stand-in ``python3`` that logs each call (fails the ones named in FAIL,
    sleeps in the ones named in SLOW): the parts run in the order asked, a failing part does not stop the
    next, a part that overruns its share of GPU_BUDGET_S is stopped, one with no time left is skipped,
    parts.log says which, and the results land flat in the output folder."""
    import os
    import subprocess

    shims = tmp_path / "bin"
    shims.mkdir()
    log = tmp_path / "calls.log"
    (shims / "python3").write_text(
        '#!/usr/bin/env bash\necho "${DISABLE_ADDMM_CUDA_LT:+[addmm off cuBLASLt] }$*" >> "$CALLS"\n'
        '[ "$1 $2" = "-m bench.bert_base" ] && mkdir -p "$3" && touch "$3/config.json"\n'  # the model, once
        '[[ "$*" == *version_info* ]] && echo 3.12\n'  # its Python version, asked where a kit is used
        '[ -n "$SLOW" ] && [[ "$*" == *"$SLOW"* ]] && sleep 30\n'
        '[ -n "$FAIL" ] && [[ "$*" == *"$FAIL"* ]] && exit 1\nexit 0\n')
    (shims / "python3").chmod(0o755)
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "speed").mkdir(parents=True)
    (work / "speed" / "bench.md").write_text("the table\n")  # what bench/run.py writes
    (work / "speed" / "bench.json").write_text("{}\n")

    def gpu_check(*args, fail="", slow="", **env):
        log.unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "CALLS": str(log), "FAIL": fail,
               "SLOW": slow, "GPU_WORK": str(work), "GPU_KIT": str(tmp_path / "no-kit"), **env}
        proc = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), str(out), *args], env=env,
                              capture_output=True, text=True, timeout=60)
        calls = log.read_text().splitlines() if log.exists() else []
        parts = (out / "parts.log").read_text().splitlines() if (out / "parts.log").exists() else []
        return proc, calls, parts

    proc, calls, parts = gpu_check("graphs", "speed")
    assert proc.returncode == 0, proc.stderr
    expected = ["-c import torch", "-m bench.bert_base", "-m bench.cuda_graphs", "bench/run.py --datasets"]
    assert len(calls) == len(expected) and all(c.startswith(e) for c, e in zip(calls, expected)), calls
    assert [p.split(":")[0] + ":" + p.split(":")[1].split(" in ")[0] for p in parts] == ["graphs: passed",
                                                                                         "speed: passed"]
    assert (out / "speed.md").read_text() == "the table\n"  # the table, where a GPU lease brings files back
    assert (out / "speed.json").read_text() == "{}\n"  # and the raw runs

    # the tests part runs on pytest-xdist's workers where it is installed, and in one process where not
    proc, calls, parts = gpu_check("tests")
    assert proc.returncode == 0 and calls[1] == "-m pytest -p no:cacheprovider -n 0 -q --co -m gpu tests/test_gpu.py"
    assert calls[2].startswith("-m pytest -m gpu -v -s -rs -p no:cacheprovider -k not fsdp and not deepspeed "
                               "-n 4 --dist load tests/test_gpu.py")
    proc, calls, parts = gpu_check("tests", GPU_TEST_WORKERS="8")
    assert " -n 8 --dist load tests/test_gpu.py" in calls[2]
    proc, calls, parts = gpu_check("tests", GPU_TESTS_K="fused or fusion")  # the tests of what changed
    assert calls[2].startswith("-m pytest -m gpu -v -s -rs -p no:cacheprovider -k (fused or fusion) and not fsdp "
                               "and not deepspeed -n 4 --dist load tests/test_gpu.py")
    proc, calls, parts = gpu_check("tests", fail="-n 0 -q --co", GPU_TEST_WORKERS="8")
    assert proc.returncode == 0 and calls[2].startswith("-m pytest -m gpu -v -s -rs -p no:cacheprovider -k not fsdp "
                                                        "and not deepspeed tests/test_gpu.py")

    proc, calls, parts = gpu_check(fail="-m pytest")
    assert proc.returncode == 1 and "failed: tests engines" in proc.stderr
    assert [" ".join(c.split()[:3 + c.startswith("-m bench.cuda_graphs")]) for c in calls if c.startswith("-m ")] == [
        "-m pytest -p", "-m pytest -m", "-m bench.probe device", "-m bench.cuda_graphs --compiled --bias-apart",
        "-m bench.captured_update model.name_or_path=" + str(work / "bert-base"),
        "-m bench.products --model", "-m bench.attention --model", "-m bench.probe casts",
        "-m bench.predict " + str(work / "bert-base"), "-m bench.predict " + str(work / "bert-base"), "-m pytest -m",
        "-m bench.tokenizing --rows"]
    predict_runs = [c for c in calls if c.startswith("-m bench.predict")]  # the precisions, then the workers
    assert "--config configs/bbc_news.yaml" in predict_runs[0] and "--workers" not in predict_runs[0]
    assert predict_runs[1].endswith("--texts 20000 --batch-size 64 --rounds 3 --workers 4 --precision bf16")
    assert [p.split(" in ")[0] for p in parts] == ["tests: failed (1)", "speed: passed", "host: passed",
                                                   "graphs: passed", "update: passed", "products: passed",
                                                   "casts: passed",
                                                   "predict: passed", "engines: failed (1)", "compile: passed",
                                                   "apart: passed", "autotune: passed", "tokenizing: passed"]
    update_run = next(c for c in calls if c.startswith("-m bench.captured_update"))
    assert "training.per_device_train_batch_size=64" in update_run and "training.effective_batch_size=256" in update_run
    products_run = next(c for c in calls if c.startswith("-m bench.products"))
    assert f"--model {work / 'bert-base'} --batch 64 --length 128 --micro-batches 4 --json {out}/products.json" in products_run
    # and again with ATen's addmm kept off cuBLASLt, into a file of its own
    assert calls[calls.index(products_run) + 1] == (f"[addmm off cuBLASLt] -m bench.products --model {work / 'bert-base'} "
                                                    f"--batch 64 --length 128 --micro-batches 4 --json "
                                                    f"{out}/products-no-lt.json")
    assert calls[calls.index(products_run) + 2] == (f"-m bench.attention --model {work / 'bert-base'} --batch 64 "
                                                    f"--length 128 --micro-batches 4 --json {out}/attention.json")
    # the host's cores tokenizing, with the kit's tokenizer where there is one (none here)
    assert calls[-1] == "-m bench.tokenizing --rows 100000,300000 --processes 1,4,8,16 --rounds 1"
    compile_run, apart_run, autotune_run = [c for c in calls if c.startswith("bench/run.py")][-3:]
    assert "--bbc-steps 120 --repeats 1 --graphs --only =bbc/trainer,=bbc/ours,=bbc/ours compiled graphs," in compile_run
    blocks = "=bbc/ours compiled blocks graphs"
    levers = ("all levers", "cudnn attention", "fusion", "bias apart fusion", "bias apart", "addmm without cublaslt")
    assert ("--bbc-steps 120 --repeats 1 --graphs --only =bbc/ours,=bbc/ours compiled blocks graphs,"
            + ",".join(f"{blocks} {lever},=bbc/ours {lever}" for lever in levers)
            + " --out " + str(work / "apart")) in apart_run
    assert ("--bbc-steps 120 --repeats 1 --graphs --only =bbc/trainer,=bbc/ours compiled blocks graphs,"
            "=bbc/ours compiled blocks autotuned graphs --out " + str(work / "autotune")) in autotune_run

    # the engines' tests without their speed rows, to run beside the tests part
    proc, calls, parts = gpu_check("engines", GPU_ENGINE_REPEATS="0")
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[1] for c in calls if c.startswith("-m ")] == ["pytest"]
    assert not any(c.startswith("bench/run.py") for c in calls) and parts[0].startswith("engines: passed")

    # 2 s of budget: the probe, which sleeps, is stopped when they are up
    proc, calls, parts = gpu_check("casts", slow="bench.probe", GPU_BUDGET_S="2", GPU_RESERVE_S="1")
    assert proc.returncode == 1 and "failed: casts" in proc.stderr
    assert len(parts) == 1 and parts[0].startswith("casts: timed out in ") and int(parts[0].split()[-1][:-1]) < 10
    # 3 s, of which the part after casts keeps 2: casts would have 1, under the 2 a part needs, and is skipped
    proc, calls, parts = gpu_check("casts", "tests", GPU_BUDGET_S="3", GPU_RESERVE_S="2")
    assert proc.returncode == 0, proc.stderr
    assert parts[0] == "casts: skipped, 1s of GPU_BUDGET_S=3 left for it" and parts[1].startswith("tests: passed")
    assert not any("bench.probe" in c for c in calls) and any(c.startswith("-m pytest") for c in calls)

    # a kit for a machine without network: its wheels installed once under the work folder, its tokenizer used
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    (kit / "wheels" / "datasets-1-py3-none-any.whl").write_bytes(b"")
    (kit / "tokenizer").mkdir()
    (work / "bert-base" / "config.json").unlink()
    proc, calls, parts = gpu_check("graphs", GPU_KIT=str(kit), FINETUNE_TOKENIZER="")
    assert proc.returncode == 0, proc.stderr
    calls = [c for c in calls if "version_info" not in c]
    assert calls[0].startswith("-m pip install") and calls[0].endswith(f"--target {work}/site {kit}/wheels/"
                                                                         "datasets-1-py3-none-any.whl")
    assert calls[2] == f"-m bench.bert_base {work}/bert-base --tokenizer {kit}/tokenizer"

    # a kit built for another Python is refused before anything runs, with the command that builds the right one
    (kit / "python-version").write_text("3.99\n")
    proc, calls, parts = gpu_check("graphs", GPU_KIT=str(kit), FINETUNE_TOKENIZER="")
    assert proc.returncode == 2 and "holds wheels for Python 3.99, this is 3.12" in proc.stderr
    assert f"bench/gpu_kit.sh {kit} " in proc.stderr and not any(c.startswith("-m pip") for c in calls)

    proc, calls, parts = gpu_check("speeds")
    assert proc.returncode == 2 and "no part 'speeds'" in proc.stderr and calls == []


def test_combine_pairs_rounds_within_each_report_only(tmp_path):
    import json

    from bench.run import main

    def report(ours, trainer):
        results = [{"job": job, "round": 0, "seed": None, "ok": True, "updates": 4, "samples": 128, "tokens": 2560,
                    "train_seconds": 128 / speed, "eval": {}} for job, speed in (("sms/ours", ours),
                                                                                 ("sms/trainer", trainer))]
        rows = {job: {"label": job, "role": "main", "b": 8, "k": 4} for job in ("sms/ours", "sms/trainer")}
        return {"command": "run", "smoke": False, "precision": "no", "repeats": 1, "accuracy_seeds": 0,
                "overrides": [], "wall_minutes": 1.0, "trainer_grad_check": None, "peak": None, "flops_model": {},
                "rows": rows, "results": results, "code": {"commit": "c", "finetune_tree": "t", "dirty": False},
                "machine": {"gpu": None, "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                            "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"}}

    for name, speeds in (("fast", (90.0, 60.0)), ("slow", (40.0, 20.0))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps(report(*speeds)))
    assert main(["--combine", str(tmp_path / "fast"), str(tmp_path / "slow"), "--out", str(tmp_path / "both")]) == 0
    ours = json.loads((tmp_path / "both" / "bench.json").read_text())["rows"]["sms/ours"]
    assert ours["samples_per_s_x_trainer_by_round"] == pytest.approx([1.5, 2.0])


def test_combine_pools_seeds_of_two_reports_and_refuses_overlaps(tmp_path, capsys):
    """``--combine``: accuracy runs of other seeds, run later, join the same rows; the same seed twice is refused."""
    import json

    from bench.run import main

    clean = {"commit": "c1", "finetune_tree": "t1", "dirty": False}

    def report(seeds, overrides=(), code=clean):
        results = [{"job": job, "seed": seed, "ok": True, "updates": 10, "samples": 320, "tokens": 3200,
                    "train_seconds": 10.0, "eval": {"f1": f1 + (seed - 42) / 100, "accuracy": 0.99}}
                   for seed in seeds for job, f1 in (("sms/ours accuracy", 0.90), ("sms/trainer accuracy", 0.92))]
        rows = {job: {"label": job, "role": "accuracy", "b": 16, "k": 2}
                for job in ("sms/ours accuracy", "sms/trainer accuracy")}
        return {"command": f"run {seeds}", "smoke": False, "precision": "no", "repeats": 3, "accuracy_seeds": len(seeds),
                "overrides": list(overrides), "wall_minutes": 1.0, "trainer_grad_check": None, "peak": None,
                "flops_model": {}, "rows": rows, "results": results, "code": code,
                "machine": {"gpu": None, "cpu": "cpu", "cores_available": 1, "threads_per_arm": 1, "memory_gib": 1,
                            "torch": "t", "transformers": "t", "accelerate": "a", "commit": "c"}}

    other_package = {"commit": "c2", "finetune_tree": "t2", "dirty": False}
    same_package = {"commit": "c3", "finetune_tree": "t1", "dirty": False}  # a later commit that left finetune/
    for name, seeds, overrides, code in (("a", [42, 43], (), clean), ("b", [44], (), same_package),
                                         ("c", [43], (), clean), ("d", [45], ("model.dropout=0.0",), clean),
                                         ("e", [46], (), other_package), ("f", [47], (), {**clean, "dirty": True}),
                                         ("g", [48], (), None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps(report(seeds, overrides, code)))

    assert main(["--combine", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "ab")]) == 0
    pooled = json.loads((tmp_path / "ab" / "bench.json").read_text())
    ours = pooled["rows"]["sms/ours accuracy"]
    assert sorted(ours["eval_by_seed"]) == ["42", "43", "44"]
    assert ours["eval"]["f1"] == pytest.approx(0.91)
    assert ours["f1_minus_trainer_pt"] == pytest.approx(-2.0)
    assert pooled["combined_from"] == ["run [42, 43]", "run [44]"]
    assert "seeds 42, 43, 44" in (tmp_path / "ab" / "bench.md").read_text()

    assert main(["--combine", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "ac")]) == 2
    assert "sms/ours accuracy seed 43 is in both" in capsys.readouterr().err
    assert main(["--combine", str(tmp_path / "a"), str(tmp_path / "d"), "--out", str(tmp_path / "ad")]) == 2
    assert "not the same job" in capsys.readouterr().err
    # runs of another package, or of uncommitted code, are not pooled; an older report without a version is
    assert main(["--combine", str(tmp_path / "a"), str(tmp_path / "e"), "--out", str(tmp_path / "ae")]) == 2
    assert "not the same package" in capsys.readouterr().err
    assert main(["--combine", str(tmp_path / "a"), str(tmp_path / "f"), "--out", str(tmp_path / "af")]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    for name in ("ac", "ad", "ae", "af"):
        assert not (tmp_path / name).exists(), name
    assert main(["--combine", str(tmp_path / "a"), str(tmp_path / "g"), "--out", str(tmp_path / "ag")]) == 0
    assert "records no code version" in capsys.readouterr().err


def test_code_version_names_the_package_tree_and_uncommitted_changes(tmp_path, monkeypatch):
    import subprocess

    import bench.run

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "finetune").mkdir()
    (tmp_path / "finetune" / "loop.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("a\n")
    git("add", ".")
    git("commit", "-qm", "one")
    monkeypatch.setattr(bench.run, "REPO", tmp_path)
    first = bench.run.code_version()
    assert first == {"commit": git("rev-parse", "--short", "HEAD"), "finetune_tree": git("rev-parse", "HEAD:finetune"),
                     "dirty": False}
    (tmp_path / "README.md").write_text("b\n")  # outside the package: neither dirty nor another tree
    assert bench.run.code_version()["dirty"] is False
    git("commit", "-qam", "docs")
    assert bench.run.code_version()["finetune_tree"] == first["finetune_tree"]
    (tmp_path / "finetune" / "loop.py").write_text("x = 2\n")
    assert bench.run.code_version()["dirty"] is True


def test_bf16_accuracy_runs_bring_the_package_in_fp32_to_pair_with(tmp_path):
    """In bf16 the package also trains in fp32, seed by seed, so its paired F1 difference is bf16's cost."""
    from bench.run import Settings, accuracy_jobs, seeded_rounds

    def jobs(precision, only=()):
        s = Settings(out=tmp_path, repeats=1, threads=1, precision=precision, smoke=False, sms_steps=2, bbc_steps=1,
                     datasets=["sms"], only=list(only), accuracy_seeds=2)
        return accuracy_jobs(s, trainer_k1=True)

    fp32 = [j for j in jobs("bf16") if j.name == "sms/ours accuracy, fp32"]
    assert len(fp32) == 1 and fp32[0].spec.precision == "no" and fp32[0].spec.arm == "ours"
    assert {j.spec.precision for j in jobs("bf16") if j.name != fp32[0].name} == {"bf16"}
    assert "sms/ours accuracy, fp32" not in [j.name for j in jobs("no")]
    # --only "ours accuracy" runs the pair; every seed trains both
    pair = jobs("bf16", only=["ours accuracy"])
    assert [j.name for j in pair] == ["sms/ours accuracy", "sms/ours accuracy, fp32"]
    assert [[(j.name, j.seed) for j in r] for r in seeded_rounds(pair, 2)] == [
        [("sms/ours accuracy", 42), ("sms/ours accuracy, fp32", 42)],
        [("sms/ours accuracy, fp32", 43), ("sms/ours accuracy", 43)]]


def test_only_selects_arms_by_substring_or_exact_name():
    from bench.run import selected

    names = ["sms/trainer accuracy", "sms/trainer accuracy, package order", "sms/ours accuracy"]
    assert [n for n in names if selected(n, ["trainer accuracy"])] == names[:2]
    assert [n for n in names if selected(n, ["=sms/trainer accuracy", "ours"])] == [names[0], names[2]]
    assert all(selected(n, []) for n in names)


def test_the_gpu_checks_default_arms_leave_out_the_compiled_graphs_whose_compile_outlasts_a_short_run(tmp_path):
    import re

    from bench.run import Settings, main_jobs

    default_arms = re.search(r'arms=\$\{GPU_ARMS:-([^}]*)\}', (REPO / "bench" / "gpu.sh").read_text()).group(1)
    s = Settings(out=tmp_path, repeats=1, threads=1, precision="bf16", smoke=False, sms_steps=None, bbc_steps=40,
                 datasets=["bbc"], batching={"bbc": (64, 4)}, graphs=True)
    every = {j.name: j for j in main_jobs(s, trainer_k1=False)}
    assert set(every["bbc/ours compiled graphs"].spec.overrides) >= {"training.cuda_graphs=true",
                                                                    "training.torch_compile=true"}
    s.only = default_arms.split(",")
    assert sorted(j.name for j in main_jobs(s, trainer_k1=False)) == [
        "bbc/ours", "bbc/ours bk1", "bbc/ours eager", "bbc/trainer"]
    # the package's own arm is graphed by its default (training.cuda_graphs: auto); the eager arm turns it off
    assert "training.cuda_graphs=false" in every["bbc/ours eager"].spec.overrides
    assert not any(o.startswith("training.cuda_graphs") for o in every["bbc/ours"].spec.overrides)
    assert set(every["bbc/ours compiled blocks graphs"].spec.overrides) >= {"training.cuda_graphs=true",
                                                                           "training.torch_compile=blocks"}
    s.only = ["=bbc/trainer", "=bbc/ours compiled graphs"]
    assert sorted(j.name for j in main_jobs(s, trainer_k1=False)) == ["bbc/ours compiled graphs", "bbc/trainer"]
    # the autotuned arm is the compiled blocks' arm with inductor's max-autotune settings in its environment alone
    autotuned, blocks = every["bbc/ours compiled blocks autotuned graphs"].spec, every["bbc/ours compiled blocks graphs"].spec
    assert autotuned.overrides == blocks.overrides
    assert autotuned.env == {**blocks.env, "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
    assert not any(key.startswith("TORCHINDUCTOR") for key in blocks.env)
    # the biases' arm is the compiled blocks' arm with training.bias_apart on, and nothing else changed
    apart = every["bbc/ours compiled blocks graphs bias apart"].spec
    assert apart.overrides == blocks.overrides + ["training.bias_apart=true"] and apart.env == blocks.env
    assert every["bbc/ours bias apart"].spec.overrides == every["bbc/ours"].spec.overrides + ["training.bias_apart=true"]
    # each lever's arm is the default's and the compiled blocks' with its settings, nothing else changed; the
    # compiled blocks' levers first, all three together leading, ATen's switch last, so that a part cut short by
    # its time limit has measured what decides the MFU first
    levers = {"all levers": ["training.bias_apart=true", "training.gradient_accumulation_fusion=true",
                             "training.attention_kernel=cudnn"],
              "cudnn attention": ["training.attention_kernel=cudnn"],
              "fusion": ["training.gradient_accumulation_fusion=true"],
              "bias apart fusion": ["training.bias_apart=true", "training.gradient_accumulation_fusion=true"],
              "bias apart": ["training.bias_apart=true"]}
    plains = ("bbc/ours compiled blocks graphs", "bbc/ours")
    for plain in plains:
        for lever, settings in levers.items():
            assert every[f"{plain} {lever}"].spec.overrides == every[plain].spec.overrides + settings
            assert every[f"{plain} {lever}"].spec.env == every[plain].spec.env
    order = [f"{plain} {lever}" for plain in plains for lever in levers]
    order += [f"{plain} addmm without cublaslt" for plain in plains]
    assert [name for name in every if name in order] == order
    # and ATen's switch in the environment alone, of the default and of the compiled blocks' arm
    for name, plain in (("bbc/ours addmm without cublaslt", "bbc/ours"),
                        ("bbc/ours compiled blocks graphs addmm without cublaslt", "bbc/ours compiled blocks graphs")):
        assert every[name].spec.overrides == every[plain].spec.overrides
        assert every[name].spec.env == {**every[plain].spec.env, "DISABLE_ADDMM_CUDA_LT": "1"}


def test_every_benchmark_run_compiles_into_an_empty_cache_of_its_own(tmp_path, monkeypatch):
    """A compiled arm's cold start is a first run's: no run finds the kernels an earlier round or arm compiled."""
    from pathlib import Path
    from types import SimpleNamespace

    import bench.run as bench_run
    from bench.run import Settings, main_jobs, run_job

    seen, autotuned = [], []

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        seen.append((env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"]))
        autotuned.append(env.get("TORCHINDUCTOR_MAX_AUTOTUNE"))
        return SimpleNamespace(returncode=1)

    monkeypatch.setattr(bench_run.subprocess, "run", fake_run)
    s = Settings(out=tmp_path, repeats=1, threads=1, precision="bf16", smoke=False, sms_steps=None, bbc_steps=40,
                 datasets=["bbc"], batching={"bbc": (64, 4)}, graphs=True)
    jobs = {j.name: j for j in main_jobs(s, trainer_k1=False)}
    for index, name in enumerate(["bbc/ours compiled graphs", "bbc/ours compiled blocks graphs",
                                  "bbc/ours compiled graphs", "bbc/ours compiled blocks autotuned graphs"]):
        assert run_job(jobs[name], s, index)["ok"] is False
    inductor = [Path(a) for a, _ in seen]
    assert len(set(inductor)) == 4 and all(not p.exists() for p in inductor)
    assert autotuned == [None, None, None, "1"]  # the autotuned arm's process alone is told to autotune
    assert all(p.is_relative_to(tmp_path / "runs") for a, b in seen for p in (Path(a), Path(b)))


def test_profile_probe_finds_the_mask_draws_it_groups(tiny_job, fresh_accelerate_state):
    from bench.probe import markdown, profile

    def run(*overrides):
        result = profile(1, tiny_job + list(overrides), updates=2, warmup=1)
        assert result["groups"]["matrix products"] > 0
        return result, result["group_calls"]["dropout masks"]

    fast, fast_ops = run("model.dropout=0.1")
    torch_masks, torch_ops = run("model.dropout=0.1", "training.fast_dropout_masks=false")
    off, off_ops = run("model.dropout=0.0")
    # 16-bit masks are random_ draws and torch's are bernoulli_; without dropout only the DataLoader's
    # seed draws are left in the group. Calls are counted, not timed: a loaded machine changes times.
    from transformers import BertConfig

    from finetune.cpu.dropout import attention_switch_unavailable

    assert fast_ops.get("aten::random_", 0) > 10 and torch_ops.get("aten::bernoulli_", 0) > 10
    if attention_switch_unavailable(BertConfig()) is None:
        assert "aten::bernoulli_" not in fast_ops
    else:  # transformers 4.x: the attention's dropout stays torch's, the other dropouts switch
        assert 0 < fast_ops["aten::bernoulli_"] < torch_ops["aten::bernoulli_"]
    assert sum(off_ops.values()) * 10 < min(sum(fast_ops.values()), sum(torch_ops.values()))
    assert "| dropout masks |" in markdown("profile", fast)


def test_op_clock_sees_backward_ops_and_counts_matmuls_at_new_shapes_once():
    import torch

    from bench.probe import OpClock

    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(3, 5, requires_grad=True)
    clock = OpClock()
    with clock:
        (a @ b).sum().backward()  # one mm forward, two backward (the gradients of a and b)
    assert clock.ops["aten::mm"][0] == 3 and clock.new_shape_calls == 3
    with clock:
        (a @ b).sum().backward()  # the same three shapes again
    assert clock.ops["aten::mm"][0] == 6 and clock.new_shape_calls == 3
    with clock:
        (torch.randn(7, 3) @ b).sum().backward()  # a new batch size: the forward and b's gradient are new
    assert clock.ops["aten::mm"][0] == 8 and clock.new_shape_calls == 5
    assert clock.ops["aten::mm"][1] > 0 and clock.new_shape_seconds <= clock.ops["aten::mm"][1]
    clock.restart()  # times start again; the shapes seen stay seen
    with clock:
        (a @ b).sum().backward()
    assert clock.ops["aten::mm"][0] == 3 and clock.new_shape_calls == 0


def test_heap_probe_trims_in_the_trim_rounds_only_and_pairs_them_with_keep(tiny_job, fresh_accelerate_state,
                                                                            monkeypatch):
    import finetune.cpu
    from bench.probe import heap, markdown

    trims = []
    monkeypatch.setattr(finetune.cpu, "malloc_trim", lambda: lambda pad: trims.append(pad))
    result = heap(1, tiny_job, rounds=2, updates=2, warmup=1)
    # Once in the set-up (free_cached hands the memory probe's heap back), then two rounds of two trimmed
    # updates; the warm-up and the keep rounds never trim.
    assert trims == [0] * (1 + 4)
    keep, trim = result["runs"]["keep"], result["runs"]["trim"]
    assert len(keep) == len(trim) == 2 and all(r["faults_per_update"] >= 0 for r in keep + trim)
    assert result["keep_over_trim_by_round"] == [k["tokens_per_s"] / t["tokens_per_s"] for k, t in zip(keep, trim)]
    assert "| trim |" in markdown("heap", result)


def test_the_compile_table_compares_each_precisions_steady_state_with_its_uncompiled_run():
    from bench.compile import table

    rows = [
        {"precision": "bf16", "arm": "not compiled", "warmup_s": 10.0, "steady_s_per_update": 0.5, "samples_per_s": 60.0,
         "wall_s": 75.0, "f1": 0.97},
        {"precision": "bf16", "arm": "compiled", "warmup_s": 40.0, "steady_s_per_update": 0.8, "samples_per_s": 32.0,
         "wall_s": 140.0, "f1": 0.968},
        {"precision": "no", "arm": "not compiled", "warmup_s": 14.0, "steady_s_per_update": 0.75, "samples_per_s": 41.0,
         "wall_s": 106.0, "f1": 0.97},
        {"precision": "no", "arm": "compiled", "warmup_s": 99.0, "steady_s_per_update": 0.5, "samples_per_s": 17.0,
         "wall_s": 254.0, "f1": 0.968},
    ]
    lines = table(rows).splitlines()
    assert lines[3] == "| bf16 | compiled | 40.0 | 0.800 | 0.62 | 32.0 | 140 | 0.9680 |"  # 0.5 / 0.8
    assert lines[5] == "| no | compiled | 99.0 | 0.500 | 1.50 | 17.0 | 254 | 0.9680 |"  # against fp32's own uncompiled run


def test_each_compiled_arm_starts_on_an_empty_compile_cache_and_its_rerun_on_the_one_it_filled(monkeypatch, capsys):
    """bench/compile.py's warm-up is a first run's: no arm finds another's kernels. ``--rerun`` times the second
    run of each compiled arm on its own cache; the uncompiled arm has nothing to rerun."""
    import bench.compile as compile_bench

    runs = []

    def fake_run_arm(out, updates, precision, label, overrides, config, warmup, cache=None):
        runs.append((label, overrides[-1], cache))
        return {"precision": precision, "arm": label, "warmup_s": 1.0, "steady_s_per_update": 0.5,
                "samples_per_s": 10.0, "wall_s": 2.0, "f1": 0.9}

    monkeypatch.setattr(compile_bench, "run_arm", fake_run_arm)
    compile_bench.main(["--precisions", "bf16", "--updates", "4", "--warmup", "1", "--rerun"])
    assert [(label, override) for label, override, _ in runs] == [
        ("not compiled", "training.torch_compile=false"), ("compiled", "training.torch_compile=true"),
        ("compiled (rerun)", "training.torch_compile=true"), ("compiled blocks", "training.torch_compile=blocks"),
        ("compiled blocks (rerun)", "training.torch_compile=blocks")]
    caches = [cache for _, _, cache in runs]
    assert caches[1] == caches[2] and caches[3] == caches[4]  # a rerun finds its first run's cache
    assert len({caches[0], caches[1], caches[3]}) == 3  # and no arm another's
    assert "| bf16 | compiled blocks (rerun) |" in capsys.readouterr().out


def test_the_memory_table_compares_each_setting_with_the_plain_one_and_its_plan():
    from bench.memory_levers import table

    def row(setting, measured, plan_total, samples_per_s, trainable=100, heap="keep", at_plan=1e9):
        plan = {"weights": 0.5e9, "gradients": 10, "optimizer": 20, "total": plan_total, "device": "cpu"}
        return {"size": "base", "setting": setting, "heap": heap, "peak_rss_above_baseline": measured, "plan": plan,
                "rss_at_plan_above_baseline": at_plan, "samples_per_s": samples_per_s, "trainable": trainable,
                "weights": 100}

    lines = table([row("b=8 k=4", 4e9, 3e9, 2.0), row("b=8 k=4 LoRA r=8", 2e9, 2.2e9, 1.0, trainable=1),
                   row("b=8 k=4", 3e9, 3e9, 1.5, heap="release"),
                   row("b=8 k=4 LoRA r=8", 1.5e9, 2.2e9, 1.0, trainable=1, heap="release", at_plan=0.8e9)]).splitlines()
    # added after the plan: the peak less the resident size once the plan was made (3.00); the plan's addition:
    # its total less the resident weights (2.5)
    assert lines[2] == ("| bert-base-sized | keep | b=8 k=4 | 4.00 | 1.00 | 3.00 | 0.75 | 3.00 | 0.83 | 3.50 | 2.000 "
                        "| 1.00 | 100.00% |")
    assert lines[3] == ("| bert-base-sized | keep | b=8 k=4 LoRA r=8 | 2.00 | 0.50 | 2.20 | 1.10 | 1.00 | 1.70 | 1.50 "
                        "| 1.000 | 0.50 | 1.00% |")
    # against the plain setting under the same heap
    assert lines[5] == ("| bert-base-sized | release | b=8 k=4 LoRA r=8 | 1.50 | 0.50 | 2.20 | 1.47 | 0.70 | 2.43 | 1.00 "
                        "| 1.000 | 0.67 | 1.00% |")


def test_the_long_texts_table_averages_each_setting_over_its_seeds():
    from bench.long_texts import summary

    def row(setting, seed, accuracy, f1, speed, cut=10, windows=None, peak=1.0, plan=None):
        return {"experiment": "truncation", "setting": setting, "seed": seed, "accuracy": accuracy, "f1": f1,
                "samples_per_s": speed, "texts_cut": cut, "train_rows": 100, "windows": windows, "wall_s": 1.0,
                "peak_rss_gb": peak, "plan_gb": plan}

    lines = summary([row("max_length=128 head", 0, 0.90, 0.80, 10.0), row("max_length=128 head", 1, 0.94, 0.90, 12.0,
                                                                           peak=1.5),
                     row("max_length=128 head_tail", 0, 0.96, 0.95, 11.0),
                     row("max_length=128 chunks", 0, 0.97, 0.96, 3.0, windows=130, plan=2.345)]).splitlines()
    assert lines[2] == ("| truncation | max_length=128 head | 0.9200 | 0.8500 | 0.8000-0.9000 | 11.0 | 1.50 "
                        "| - | 10 of 100 | - | 2 |")  # the peak: the highest of the seeds'
    assert lines[3] == ("| truncation | max_length=128 head_tail | 0.9600 | 0.9500 | 0.9500-0.9500 | 11.0 | 1.00 "
                        "| - | 10 of 100 | - | 1 |")
    assert lines[4] == ("| truncation | max_length=128 chunks | 0.9700 | 0.9600 | 0.9600-0.9600 | 3.0 | 1.00 "
                        "| 2.35 | 10 of 100 | 130 | 1 |")  # the memory plan beside the peak


def test_the_long_texts_benchmark_runs_each_truncation_under_each_heap_asked_for():
    from types import SimpleNamespace

    from bench.long_texts import experiments

    args = SimpleNamespace(only="truncation", lengths="256", truncations="chunks", epochs=None, max_steps=20,
                           heaps="release,auto")
    assert experiments(args) == [
        ("truncation", "max_length=256 chunks heap=release", ["bbc_news.yaml", "data.max_length=256",
                                                              "data.truncation=chunks", "training.max_steps=20",
                                                              "training.cpu_heap=release"]),
        ("truncation", "max_length=256 chunks heap=auto", ["bbc_news.yaml", "data.max_length=256",
                                                           "data.truncation=chunks", "training.max_steps=20",
                                                           "training.cpu_heap=auto"])]


def test_device_probe_times_its_ways_in_alternating_rounds_and_profiles_the_eager_one(tiny_job,
                                                                                       fresh_accelerate_state):
    """On the CPU: the two eager ways, each timed once per round, the eager one profiled (the graphed way and
    the GPU's kernels and waits need a GPU: bench/gpu.sh runs this probe there)."""
    from bench.probe import device, markdown

    result = device(1, tiny_job + ["data.max_train_samples=64"], updates=1, warmup=1, rounds=2)
    ways = result["ways"]
    assert list(ways) == ["eager", "eager, blocking copies"]
    assert all(len(w["wall_s_per_update"]) == 2 and w["waits_per_update"] is None for w in ways.values())
    assert {op["op"] for op in ways["eager"]["cpu_ops"]} & {"aten::addmm", "aten::mm", "aten::linear"}
    assert "cpu_ops" not in ways["eager, blocking copies"]
    table = markdown("device", result)
    assert "| eager, blocking copies | " in table and "| op (eager, self CPU, profiled) |" in table


def test_casts_probe_counts_a_windows_weight_casts_once_when_kept(tiny_job, fresh_accelerate_state):
    from bench.probe import casts, markdown

    # 64 training texts: every window holds k = 4 micro-batches, so each setting's counted update is a full one
    result = casts(1, tiny_job + ["training.mixed_precision=bf16", "data.max_train_samples=64"], rounds=2, updates=1,
                   warmup=1)
    every, once = result["runs"]["per micro-batch"], result["runs"]["once per update"]
    k = result["k"]
    assert result["precision"] == "bf16" and k == 4
    # the tiny BERT's linear layers: 2 x 6 in the blocks, the pooler and the head, a weight and a bias each
    weights = 2 * (2 * 6 + 2)
    assert every["casts_per_micro_batch"] - once["casts_per_micro_batch"] == pytest.approx(weights * (k - 1) / k)
    # (the other ops differ a little between the two counted updates: one of them starts an epoch)
    assert once["ops_per_micro_batch"] < every["ops_per_micro_batch"]
    assert len(every["ms_per_micro_batch"]) == len(once["ms_per_micro_batch"]) == 2
    assert "| once per update |" in markdown("casts", result)


def test_fixed_shape_micro_batches_give_the_eager_gradient(tiny_job, fresh_accelerate_state, monkeypatch):
    """What a CUDA graph needs, checked on the CPU: micro-batches padded to b rows (added rows weigh 0) and to
    one of four lengths accumulate the gradient of the package's own micro-batches, with the forward compiled
    too (``--compiled``; dynamo's aot_eager backend stands in for inductor, which compiles for minutes here)."""
    from bench.cuda_graphs import markdown, measure

    compiling_with(monkeypatch, "aot_eager")
    # 72 texts in micro-batches of 16: the fifth holds 8, so the static way pads it with 8 rows of weight 0
    result = measure(tiny_job + ["training.per_device_train_batch_size=16"], micro_batches=5, rounds=1, threads=1,
                     compiled=True, apart=True)
    assert result["micro_batches"] == 5 and result["rows"] == 16 and result["lengths"] == [8, 16, 24, 32]
    # no CUDA here: nothing graphed
    assert list(result["ms_per_micro_batch"]) == ["eager", "static", "compiled", "compiled layers",
                                                  "static, bias apart", "compiled layers, bias apart"]
    for way in ("static", "compiled", "compiled layers", "static, bias apart", "compiled layers, bias apart"):
        assert result["gradient_relative_difference"][way] < 1e-5
        assert result["mean_loss"][way] == pytest.approx(result["mean_loss"]["eager"], rel=1e-6)
    assert result["setups"]["static"]["graphs"] == result["setups"]["compiled"]["graphs"] >= 1  # one per length met
    for way in ("compiled", "compiled layers"):
        assert result["setups"][way]["seconds"] > result["setups"]["static"]["seconds"]  # the compiling
    text = markdown(result)
    assert "| static |" in text and "| compiled |" in text and "| compiled layers |" in text
    assert "| compiled layers, bias apart |" in text


def _a_tiny_bert_to_compile(monkeypatch):
    """A tiny BERT, token ids, its logits on them, and dynamo's counters, zeroed, for the aot_eager backend."""
    import torch
    from torch._dynamo.utils import counters

    from helpers import tiny_model

    compiling_with(monkeypatch, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("bert", num_labels=2, dropout=0.0)
    ids = torch.randint(5, 30, (2, 8))
    return model, ids, model(input_ids=ids).logits, counters


def test_biases_added_apart_swap_the_blocks_linear_layers_for_their_way_alone(monkeypatch):
    """Inside the way's context each linear layer of the blocks adds its bias after its product (the pooler's and
    the head's stay), to the same logits; a compiled block compiles again for the swapped layers and the model
    is handed back with plain linear layers, whose compiled blocks are reused."""
    import torch

    from bench.cuda_graphs import bias_apart, compiled_blocks, together
    from finetune.bias_apart import BiasApartLinear

    model, ids, expected, counters = _a_tiny_bert_to_compile(monkeypatch)
    plain_blocks, apart = compiled_blocks(model), bias_apart(model)
    with plain_blocks():
        torch.testing.assert_close(model(input_ids=ids).logits, expected)
    assert counters["stats"]["unique_graphs"] == 1
    with together(apart, compiled_blocks(model))():
        swapped = [m for m in model.modules() if isinstance(m, BiasApartLinear)]
        assert len(swapped) == 2 * 6  # query, key, value, attention output, feed-forward in and out, per block
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model.bert.encoder.layer[0].output.dense(torch.ones(1, 37)).dtype == torch.bfloat16
        torch.testing.assert_close(model(input_ids=ids).logits, expected)
    assert counters["stats"]["unique_graphs"] == 2  # the swapped layers: a compile of their own
    assert not any(isinstance(m, BiasApartLinear) for m in model.modules())
    with plain_blocks():
        model(input_ids=ids)
    assert counters["stats"]["unique_graphs"] == 2  # plain layers again: the first compile serves


def test_a_way_whose_capture_is_refused_is_named_and_the_others_measured(tiny_job, fresh_accelerate_state,
                                                                          monkeypatch):
    """A refused capture ends that way alone (its error no longer ends the GPU check's part): here every
    fixed-shape way's recorder raises as CUDA does, and eager is still measured and reported."""
    import finetune.cuda_graphs
    from bench.cuda_graphs import markdown, measure

    def refusing(step, pool):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nSearch for ...")

    monkeypatch.setattr(finetune.cuda_graphs, "rerun_eagerly", refusing)
    result = measure(tiny_job + ["training.per_device_train_batch_size=16"], micro_batches=2, rounds=1, threads=1)
    assert list(result["ms_per_micro_batch"]) == ["eager"] and result["ms_per_micro_batch"]["eager"] > 0
    assert result["refused"] == {"static": "CUDA error: operation not permitted when stream is capturing"}
    assert set(result["setups"]) == set() and list(result["gradient_relative_difference"]) == ["eager"]
    text = markdown(result)
    assert "static: no row, CUDA refused its capture (CUDA error: operation not permitted when stream is " \
           "capturing)." in text.splitlines()
    assert "| static |" not in text


def test_the_captured_update_makes_the_loops_updates_and_skips_a_nan_inside_the_step(tiny_job,
                                                                                     fresh_accelerate_state):
    """The update replayed from one graph (here run again, no CUDA) against the loop's eager one: the same weights
    to the bit through the schedule's warm-up (each update at its own learning rate, filled into the step's
    device tensors), and a NaN in the gradient skipped inside fused AdamW's step, with its state kept."""
    from bench.captured_update import markdown, measure

    # 72 training texts: 9 micro-batches of 8, two full windows of k = 4
    result = measure(tiny_job, windows=3, rounds=1, threads=1)
    assert (result["b"], result["k"], result["windows"]) == (8, 4, 2)
    assert result["weights_moved"] > 1e-5  # the second update's rate is past the warm-up's 0
    assert result["max_weight_difference"] == {"eager, skip on the device": 0.0, "captured update": 0.0}
    assert result["eager_rounds_difference"] == 0.0  # rounds 0 and 1 of the eager update: the floor, 0 on a CPU
    assert result["skip"] == {"weights_kept": True, "state_kept": True, "gradients_zeroed": True}
    assert list(result["ms_per_update"]) == ["eager update", "eager, skip on the device", "captured update"]
    text = markdown(result)
    assert "| captured update |" in text and "A NaN in the gradient, captured: weights kept yes" in text
    assert "the eager update's own rounds, from the same weights and micro-batches, 0 (" in text


def test_regional_compilation_compiles_the_blocks_for_its_way_alone(monkeypatch):
    """The compiled blocks' forwards are swapped in inside the way's context only (one compile, which every
    block reuses), and the model is handed back with its own forwards for the other ways."""
    import torch

    from bench.cuda_graphs import compiled_blocks
    from finetune.lora import blocks_of

    model, ids, expected, counters = _a_tiny_bert_to_compile(monkeypatch)
    inside = compiled_blocks(model)
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled until a block runs inside
    with inside():
        assert all("forward" in vars(block) for block in blocks_of(model))
        torch.testing.assert_close(model(input_ids=ids).logits, expected)
    assert counters["stats"]["unique_graphs"] == 1  # one compile for both blocks
    assert not any("forward" in vars(block) for block in blocks_of(model))
    model(input_ids=ids)
    assert counters["stats"]["unique_graphs"] == 1  # outside: the blocks' own forwards, nothing compiled


def test_the_graphs_report_says_after_how_many_micro_batches_each_way_pays():
    from bench.cuda_graphs import break_even, markdown

    result = {"device": "GPU", "precision": "bf16", "micro_batches": 24, "rows": 64, "lengths": [32, 64, 96, 128],
              "rounds": 5, "overrides": [], "samples_per_micro_batch": 64.0,
              "ms_per_micro_batch": {"eager": 45.0, "static": 46.0, "graphed": 25.0, "compiled graphed": 15.0},
              "gradient_relative_difference": {"eager": 0.0, "static": 1e-7, "graphed": 1e-7,
                                               "compiled graphed": 1e-3},
              "setups": {"static": {"graphs": 4, "seconds": 0.5, "pool_bytes": None},
                         "graphed": {"graphs": 4, "seconds": 2.0, "pool_bytes": 3 * 2**30},
                         "compiled graphed": {"graphs": 4, "seconds": 60.0, "pool_bytes": 2 * 2**30}}}
    assert break_even(result, "graphed") == pytest.approx(100.0)  # 2 s of capture at 20 ms saved per micro-batch
    assert break_even(result, "compiled graphed") == pytest.approx(2000.0)  # 60 s at 30 ms
    assert break_even(result, "static") == float("inf")  # slower than eager
    lines = markdown(result).splitlines()
    assert "| graphed | 25.00 | 2560.0 | 1.80 | 1.00e-07 | 2.0 | 100 | 3072 |" in lines
    assert "| compiled graphed | 15.00 | 4266.7 | 3.00 | 1.00e-03 | 60.0 | 2000 | 2048 |" in lines
    assert "| static | 46.00 | 1391.3 | 0.98 | 1.00e-07 | 0.5 | never |  |" in lines
    assert "| eager | 45.00 | 1422.2 | 1.00 | 0.00e+00 |  |  |  |" in lines


def test_the_padding_count_follows_each_way_over_the_same_micro_batches(tiny_job):
    """Texts of at most 32 tokens under a max_length of 128: lengths up to the longest text pad far less than
    lengths up to max_length, and eight less than four; every way computes at least the texts' own tokens."""
    from bench.padding import measure, table

    result = measure(REPO / "configs" / "default.yaml", 128, [o for o in tiny_job if "max_length" not in o])
    tokens, real = result["tokens"], result["real_tokens"]
    assert result["longest"] <= 32 and result["texts"] > 0
    assert all(t >= real for t in tokens.values())
    assert tokens["8 up to the longest"] <= tokens["4 up to the longest"] < tokens["4 up to max_length"]
    # four lengths up to 128: every micro-batch of texts of at most 32 tokens pads to 32
    assert tokens["4 up to max_length"] == 32 * sum(1 for _ in range(result["texts"]))
    assert result["x_real"]["dynamic"] == pytest.approx(tokens["dynamic"] / real)
    assert "| 128 | " in table([result])


def test_the_products_probe_times_each_way_of_a_layers_products_and_sums_an_update(tmp_path, capsys, monkeypatch):
    """bench.products on a CPU at a tiny model's sizes: each of a layer's products in every way, its FLOPs, the
    bias added apart giving linear's output, and an update's sums made of the rows (layers x micro-batches x
    each product's count), with query, key and value as one product in place of three in sums of their own."""
    import json

    from bench import products

    model = save_tiny_model(tmp_path / "tiny")
    sizes = json.loads((model / "config.json").read_text())
    hidden, intermediate, layers = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]
    out = tmp_path / "products.json"
    assert products.main(["--model", str(model), "--batch", "2", "--length", "4", "--micro-batches", "3",
                          "--rounds", "2", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["product"], r["fan_in"], r["fan_out"], r["count"]) for r in rows] == [
        ("query, key, value", hidden, hidden, 3), ("attention output", hidden, hidden, 1),
        ("feed-forward in", hidden, intermediate, 1), ("feed-forward out", intermediate, hidden, 1),
        ("query, key, value as one", hidden, 3 * hidden, 1)]
    assert [r["replaces"] for r in rows] == [None] * 4 + ["query, key, value"]
    assert all(r["tokens"] == 8 and r["flop"] == 2 * 8 * r["fan_in"] * r["fan_out"] for r in rows)
    assert all(list(r["ms"]) == list(products.FORWARD_WAYS + products.BACKWARD_WAYS) for r in rows)
    assert all(ms > 0 for r in rows for ms in r["ms"].values())
    assert all(r["relative_difference"] < 1e-6 for r in rows)  # the bias added apart: linear's output

    sums, apart, fused = result["per_update"], rows[:4], rows[1:]
    for way in products.FORWARD_WAYS:
        assert sums[f"forward, {way}"] == pytest.approx(layers * 3 * sum(r["count"] * r["ms"][way] for r in apart))
        assert sums[f"forward, {way}, query, key, value as one"] == pytest.approx(
            layers * 3 * sum(r["count"] * r["ms"][way] for r in fused))
    for chosen, name in ((apart, "backward"), (fused, "backward, query, key, value as one")):
        assert sums[name] == pytest.approx(
            layers * 3 * sum(r["count"] * (r["ms"]["grad input"] + r["ms"]["grad weight"]) for r in chosen))
    accumulation = result["accumulation"]
    assert accumulation["refused"] == {}  # in fp32 every way is a plain product
    assert [r["product"] for r in accumulation["rows"]] == [r["product"] for r in apart]
    assert all(list(r["ms"]) == list(products.ACCUMULATION_WAYS) for r in accumulation["rows"])
    for way in products.ACCUMULATION_WAYS:
        assert sums[f"weight gradients, {way}"] == pytest.approx(
            layers * 3 * sum(r["count"] * r["ms"][way] for r in accumulation["rows"]))
    for r in accumulation["rows"]:  # fp32 sums of 3 micro-batches: every way within float rounding of fp64's
        assert set(r["error"]) == set(products.ACCUMULATION_WAYS) | {products.BIG_BATCH}
        assert all(0 <= error < 1e-6 for error in r["error"].values())
    printed = capsys.readouterr().out
    assert f"| feed-forward in (8 x {hidden} x {intermediate}) | 1 | " in printed
    assert "| product (rows x in x out) | product, cast, added | fp32 product, added | accumulated by the product" \
           " | error: product, cast, added |" in printed and "relative error over 3 micro-batches" in printed
    assert f"| query, key, value as one (8 x {hidden} x {3 * hidden}) | 1, for query, key, value | " in printed
    assert "cuBLASLt" not in printed
    monkeypatch.setenv("DISABLE_ADDMM_CUDA_LT", "1")  # the GPU check's second run: its report says so
    assert products.main(["--model", str(model), "--batch", "2", "--length", "4", "--rounds", "1", "--repeats", "1"]) == 0
    assert "(CPU, addmm without cuBLASLt (DISABLE_ADDMM_CUDA_LT=1), float32," in capsys.readouterr().out
    assert f"{layers} layers, 3 micro-batches an update" in printed and "| backward | " in printed


def test_the_products_probe_names_the_ways_a_torch_refuses_and_measures_what_bf16_rounding_costs():
    """In bf16 on a CPU, which has no ``out_dtype`` products: the two fp32 ways are named as refused, the
    autograd way is timed; a weight gradient rounded to bf16 in each micro-batch lands about bf16's rounding from
    the fp64 sum, one made in fp32 from the same factors within fp32's, and the big batch's one bf16 product as
    far as bf16 rounds."""
    import torch

    from bench import products

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    ways = products.accumulation_ways(bf16, cpu)
    refused = products.refusals(ways, bf16, cpu)
    assert sorted(refused) == ["accumulated by the product", "fp32 product, added"]
    assert all(reason for reason in refused.values())
    result = products.measure_accumulation([products.Product("p", 32, 48, 1)], 64, 4, 1, 1, bf16, cpu)
    assert result["refused"] == refused and list(result["rows"][0]["ms"]) == ["product, cast, added"]
    assert "Refused by this torch: `fp32 product, added`: " in "\n".join(products.accumulation_report(result, 4))

    exact_fp32 = {"product, cast, added": ways["product, cast, added"],
                  "in fp32": lambda acc, dy, x: acc.add_(dy.float().t() @ x.float())}  # what out_dtype computes
    errors = products.accumulation_errors(products.Product("p", 256, 128, 1), 512, 4, exact_fp32, bf16, cpu)
    assert errors["in fp32"] < 1e-6
    assert 1e-4 < errors["product, cast, added"] < 1e-2 and 1e-4 < errors[products.BIG_BATCH] < 1e-2


def test_the_attention_probe_times_each_kernel_torch_runs_and_names_the_ones_it_refuses(tmp_path, capsys):
    """bench.attention on a CPU at a tiny model's sizes: torch's own choice, flash and math run (flash only without
    dropout), the memory-efficient and cuDNN kernels are refused with torch's reason; without dropout every
    kernel gives math's fp32 output and gradient; the mask is the padding's (the last text's padded keys are
    hidden, no other text changes); an update's sum is layers x micro-batches calls."""
    import json

    import torch

    from bench import attention

    model = save_tiny_model(tmp_path / "tiny")
    sizes = json.loads((model / "config.json").read_text())
    out = tmp_path / "attention.json"
    assert attention.main(["--model", str(model), "--batch", "3", "--length", "8", "--micro-batches", "2",
                           "--rounds", "2", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ran = {(r["case"], r["dropout"], r["kernel"]) for r in result["rows"]}
    assert ran == {(case, dropout, kernel) for case in ("mask", "no mask") for dropout in (0.1, 0.0)
                   for kernel in ("torch's choice", "math")} | {("mask", 0.0, "flash"), ("no mask", 0.0, "flash")}
    assert set(result["refused"]) == {f"{kernel}, {case}, dropout {dropout}" for case in ("mask", "no mask")
                                      for dropout in (0.1, 0.0) for kernel in ("efficient", "cudnn")} | {
        "flash, mask, dropout 0.1", "flash, no mask, dropout 0.1"}
    assert "dropout" in result["refused"]["flash, mask, dropout 0.1"]
    assert all(reason for reason in result["refused"].values())
    for row in result["rows"]:
        assert row["ms"] > 0 and ("difference" in row) == (row["dropout"] == 0.0)
        if row["dropout"] == 0.0:  # math is the reference; flash's blocked softmax rounds otherwise
            assert max(row["difference"].values()) < 1e-5
            assert (max(row["difference"].values()) == 0) == (row["kernel"] == "math")
    assert result["flop"] == 12 * 3 * sizes["hidden_size"] * 8 ** 2
    printed = capsys.readouterr().out
    first = result["rows"][0]
    update = first["ms"] * sizes["num_hidden_layers"] * 2
    assert f"| {first['case']} | {first['dropout']} | {first['kernel']} | {first['ms']:.4f} | " in printed
    assert f" | {update:.2f} | " in printed and "- cudnn, no mask, dropout 0.0: " in printed

    inputs = attention.attention_inputs(3, 2, 8, 4, torch.float32, torch.device("cpu"))
    masked = attention.attention_step(inputs, None, True, 0.0)().detach()
    unmasked = attention.attention_step(inputs, None, False, 0.0)().detach()
    assert torch.equal(masked[:2], unmasked[:2]) and not torch.allclose(masked[2], unmasked[2])
    assert inputs["mask"][2, 0, 0].tolist() == [True] * 6 + [False] * 2


def test_the_prediction_benchmark_times_each_precision_on_the_same_texts(tmp_path, capsys):
    from bench.predict import main

    model = save_tiny_model(tmp_path / "tiny")
    assert main([str(model), "--texts", "40", "--rounds", "1", "--batch-size", "16"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table if line.startswith("| ")}
    assert set(rows) == {"precision", "---", "float32", "bf16 autocast"}
    assert rows["float32"][2] == "1.00" and rows["float32"][-1].strip(" |") == "0.0e+00"
    assert 0 < float(rows["bf16 autocast"][-1].strip(" |")) < 0.1  # bf16 moves the probabilities, a little
    assert "(40 texts, batch 16, cpu)" in table[0]
    # batches padded in the loop against by DataLoader workers: the same probabilities, bit for bit
    assert main([str(model), "--texts", "40", "--rounds", "2", "--batch-size", "8", "--workers", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table if line.startswith("| ")}
    assert set(rows) == {"each batch padded", "---", "in the loop", "by 2 workers"}
    assert rows["in the loop"][2] == "1.00" and float(rows["by 2 workers"][2]) > 0
    assert len(rows["by 2 workers"][3].split(", ")) == 2 and "(40 texts, batch 8, no, cpu)" in table[0]
    assert table[-1] == "The same probabilities, bit for bit."
    # each batch padded to its longest text against to a multiple of 8, one model: the same labels
    assert main([str(model), "--texts", "40", "--rounds", "1", "--batch-size", "8", "--padding", "no"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "| each batch padded | texts/s (median) | x to its longest | seconds by round |" in table
    assert table[-1].startswith("Labels alike: 100.00%; largest probability difference")


def test_the_start_up_benchmark_times_each_checkout_on_the_same_generated_rows(tmp_path, capsys):
    """The default job's messages, read as a run reads them, repeated and numbered up to --rows; each way's
    setup_run timed in a fresh process (here this checkout against itself as the baseline)."""
    from bench.startup import main, write_rows

    write_rows(tmp_path / "texts.tsv", 5000)
    lines = (tmp_path / "texts.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "label\ttext" and len(lines) == 5001
    assert lines[1].split("\t")[0] in ("ham", "spam") and lines[1].endswith(" (0)") and lines[-1].endswith(" (1)")
    # --set reaches this checkout's runs and not the baseline's (here this checkout again); --set-all both
    assert main(["--rows", "300", "--rounds", "1", "--baseline", str(REPO), "--set", "data.max_train_samples=100",
                 "--set-all", "data.validation_split=0.5"]) == 0
    out, err = capsys.readouterr()
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")][2:]
    assert [row[0].split(",")[0] for row in rows] == ["| baseline", "| this checkout"]
    assert rows[1][0].endswith("(data.max_train_samples=100)")
    assert all(0 < float(row[1]) < 120 and row[2].strip(" |") == row[1] for row in rows)  # one round: its median
    reported = [line.split(": ", 1) for line in err.splitlines() if line.startswith(("baseline", "this checkout"))]
    assert [json.loads(result)["train_rows"] for _, result in reported] == [150, 100]
    # the dry run's rehearsal, its estimate of an evaluation and the evaluation itself, each way
    assert main(["--rows", "300", "--rounds", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| way | rehearsal seconds (median) | its estimate of an evaluation | the evaluation | rounds |" in out
    (row,) = [line.split(" | ") for line in out.splitlines() if line.startswith("| this checkout")]
    assert all(float(value) > 0 for value in row[1:4])
    # the command a user types, to its one-line error on a file without the label column it names; each checkout
    # in the same rounds (here this one as its own baseline: the cheapest of the three ways to time twice)
    assert main(["--rows", "300", "--rounds", "1", "--data-error", "--baseline", str(REPO)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][2:]
    assert [row[0].split(",")[0] for row in rows] == ["| baseline", "| this checkout"]
    for row in rows:
        assert 0 < float(row[1]) < 120 and "error: texts.tsv: no column 'sentiment' (data.label_column)" in row[3]
    # finetune predict of a text given on the command line, to its printed prediction
    assert main(["--rounds", "1", "--predict"]) == 0
    out = capsys.readouterr().out
    assert "| way | seconds to the prediction (median) | rounds |" in out
    (row,) = [line.split(" | ") for line in out.splitlines() if line.startswith("| this checkout")]
    assert 0 < float(row[1]) < 120 and row[2].strip(" |") == row[1]


def test_the_tokenizing_benchmark_times_each_number_of_processes_and_auto_on_the_same_rows(capsys):
    """The default job's split at a number of rows, tokenized by each number of processes and by auto, each in a
    fresh process; the ways must make the same tokens (the benchmark stops otherwise)."""
    from bench.tokenizing import main

    assert main(["--rows", "300", "--processes", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Command: `python -m bench.tokenizing --rows 300 --processes 2 --rounds 1`")
    assert "| rows | 2 processes (s) | auto (its processes) (s) | fastest | auto against 2 |" in out
    (row,) = [line.strip("|").split(" | ") for line in out.splitlines() if line.startswith("| 300 ")]
    assert float(row[1]) > 0 and row[2].endswith(" (1)")  # auto: one process for 300 rows
    assert row[3] == "2" and float(row[4].rstrip("x |")) > 0


def test_the_launched_prediction_benchmark_times_each_number_of_processes_on_the_same_texts(tmp_path, capsys):
    """The default job's messages, one a line, numbered; ``finetune predict`` timed alone and under a launch of
    two processes, both writing the same predictions (here this checkout, no baseline)."""
    from bench.predict_processes import main, write_texts

    write_texts(tmp_path / "texts.txt", 5000)
    lines = (tmp_path / "texts.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5000 and lines[0].endswith(" (0)") and lines[-1].endswith(" (1)")
    assert main(["--texts", "50", "--processes", "1,2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "50 texts; every way wrote the same predictions, byte for byte." in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| this checkout")]
    assert [int(row[1]) for row in rows] == [1, 2]
    assert all(0 < float(row[2]) < 300 and row[4].strip(" |") == row[2] for row in rows)  # one round: its median


def test_the_intervals_benchmark_times_the_metrics_and_their_intervals_for_each_shape(capsys, monkeypatch):
    import bench.intervals

    monkeypatch.setattr(bench.intervals, "SHAPES", ((2, 50), (3, 80)))
    monkeypatch.setattr(bench.intervals, "NUMBERS", (60,))
    assert bench.intervals.main(["--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "Command: `python -m bench.intervals --rounds 1`" in out
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")][2:]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [("2", 50), ("3", 80), ("a number (regression)", 60)]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_the_intervals_benchmarks_ranking_mode_times_roc_auc_and_its_intervals_up_to_the_limit(capsys, monkeypatch):
    import bench.intervals
    import finetune.metrics.intervals

    monkeypatch.setattr(bench.intervals, "RANKED_SHAPES", ((2, 50), (3, 40), (2, 300)))
    monkeypatch.setattr(finetune.metrics.intervals, "MOST_PAIRS_FOR_AN_INTERVAL", 200)
    assert bench.intervals.main(["--ranking", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "Command: `python -m bench.intervals --ranking --rounds 1`" in out
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ")][2:]
    assert [(r[0], r[1], r[2]) for r in rows] == [("2", "50", "50"), ("3", "40", "120"), ("2", "300", "300")]
    assert all(float(r[3]) > 0 for r in rows) and float(rows[0][4]) > 0 and float(rows[1][4]) > 0
    assert rows[2][4] == "none (past the limit)"  # 300 pairs, past the 200 allowed


def test_the_thresholds_job_tags_real_messages_by_their_cues_and_holds_a_fifth_out(tmp_path):
    import json
    import re

    from bench.thresholds import CUES, DROPPED, write_tagged

    train, test = write_tagged(tmp_path)
    rows = [json.loads(line) for path in (train, test) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4862 and len(test.read_text(encoding="utf-8").splitlines()) == 972
    kept = cued = 0
    for row in rows:
        words = set(re.findall(r"[a-z£]+", row["text"].lower()))
        cues = {tag for tag, listed in CUES.items() if words & set(listed.split())}
        assert set(row["tags"]) - {"spam"} <= cues  # a tag only where its cue is; some dropped
        kept += len(set(row["tags"]) & cues)
        cued += len(cues)
    assert abs(1 - kept / cued - DROPPED) < 0.02
    assert 0.10 < sum("spam" in row["tags"] for row in rows) / len(rows) < 0.13  # the collection's own label


def test_the_two_class_thresholds_job_holds_a_fifth_of_the_messages_out_with_their_own_labels(tmp_path):
    import csv

    from bench.thresholds import SMS, write_two_classes
    from finetune.resources import resolve_path

    train, test = write_two_classes(tmp_path)
    parts = [list(csv.reader(path.open(encoding="utf-8", newline=""))) for path in (train, test)]
    assert all(part[0] == ["label", "text"] for part in parts)
    assert len(parts[1]) - 1 == 972 and len(parts[0]) - 1 == 4862 - 972
    original = sorted(line.split("\t", 1) for line in
                      open(resolve_path(SMS), encoding="utf-8").read().splitlines())
    assert sorted(row for part in parts for row in part[1:]) == original  # every message once, with its label


def test_the_carves_ks_distance_is_the_largest_gap_between_the_two_cumulative_distributions():
    import numpy as np

    from bench.carves import ks_distance, rating_targets

    whole = np.arange(10.0)
    assert ks_distance(whole, whole) == 0.0
    assert ks_distance(whole[:5], whole) == 0.5  # below 4.5: all of the first half, half of the whole
    assert ks_distance(np.array([0.0, 9.0]), whole) == 0.4  # at 0: half of one, a tenth of the other
    ratings = rating_targets(300)
    assert len(ratings) == 300 and 0 <= ratings.min() and ratings.max() < 5.5


def test_the_trackers_benchmark_times_each_way_of_logging_and_checks_the_store_holds_every_record(
        capsys, monkeypatch, fresh_accelerate_state):
    import bench.trackers
    from finetune.tracker_runs import SENDERS

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset")  # the benchmark points it at a store of its own
    assert bench.trackers.main(["--records", "6", "--update-ms", "0", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "`python -m bench.trackers --records 6 --update-ms 0 --rounds 1`" in out
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")][2:]
    assert [r[0].strip() for r in rows] == list(bench.trackers.ARMS)
    assert all(float(r[1]) > 0 and r[3].strip() == "6 of 6" for r in rows)
    assert "mlflow" in SENDERS  # the package's own way, restored


def test_the_families_bench_tells_a_family_that_keeps_the_contract_from_one_that_reads_the_padding():
    from bench.families import measure, table

    bert, convbert, missing = measure("bert"), measure("convbert"), measure("no-such-family")
    assert bert["updates"] == 6 and bert["keeps"] and bert["largest"] < 1e-6
    # ConvBERT's convolutions read the padded positions beside a text: its weights part past rounding, and
    # padded to one length (as data.padding: auto pads it) they do not
    assert not convbert["keeps"] and convbert["largest_but_key_biases"] > 1e-5
    assert convbert["keeps_one_length"] and convbert["one_length"] < 1e-6
    assert bert["keeps_one_length"] and bert["one_length"] < 1e-6
    assert missing == {"family": "no-such-family", "why": "not in this transformers release"}
    rows = table([bert, convbert, missing]).splitlines()
    assert rows[2].startswith("| bert | yes |") and rows[2].endswith("| yes |")
    assert rows[3].startswith("| convbert | yes (padded to one length) |") and "| **no** |" in rows[3]
    assert rows[3].endswith("| yes |")
    assert rows[4] == "| no-such-family | no | | | not in this transformers release | | | |"


def test_the_ensemble_table_gives_each_metrics_fold_range_and_the_five_against_the_one_model():
    from bench.ensemble import table

    alone = [{"accuracy": 0.90, "f1": 0.50, "average_precision": 0.7, "loss": 0.30},
             {"accuracy": 0.94, "f1": 0.70, "average_precision": 0.9, "loss": 0.10}]
    row = {"split": 7, "alone": alone,
           "together": {"accuracy": 0.95, "f1": 0.65, "average_precision": 0.85, "loss": 0.12},
           "whole": {"accuracy": 0.93, "f1": 0.68, "average_precision": 0.80, "loss": 0.15},
           "intervals": {"accuracy": [-0.01, 0.05], "f1": [-0.1, 0.04], "average_precision": [0.0, 0.1]}}
    lines = table([row]).splitlines()
    assert lines[2] == "| 7 | accuracy | 0.9200 (0.9000-0.9400) | 0.9500 | 0.9300 | +0.0200 (-0.0100 to +0.0500) |"
    assert lines[3] == "| 7 | f1 | 0.6000 (0.5000-0.7000) | 0.6500 | 0.6800 | -0.0300 (-0.1000 to +0.0400) |"
    assert lines[5] == "| 7 | loss | 0.2000 (0.1000-0.3000) | 0.1200 | 0.1500 | -0.0300 |"  # no interval: not paired
