"""``logging.report_to``: any tracker Accelerate supports, checked at start-up.

TensorBoard itself is tested end to end in test_cli.py (its event file is read back).
"""

from __future__ import annotations

import sys

import pytest
import yaml

import forked
from helpers import make_texts, offline_env, save_tiny_model, write_tsv

from finetune.errors import ConfigError
from finetune.tracking import check_trackers


def missing_tracker() -> str:
    """A tracker Accelerate supports whose package is not installed here."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    missing = [name for name in ("wandb", "mlflow", "trackio", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
               if name in LOGGER_TYPE_TO_CLASS and name not in available]
    if not missing:
        pytest.skip("every tracker package is installed")
    return missing[0]


def test_installed_and_known_trackers_pass():
    check_trackers([])
    check_trackers(["tensorboard"])
    check_trackers(["all"])


def test_unknown_tracker_names_the_key():
    with pytest.raises(ConfigError) as info:
        check_trackers(["tensorboard", "tensorbord"])
    assert str(info.value) == "logging.report_to: unknown tracker 'tensorbord' (did you mean 'tensorboard'?)"


@pytest.mark.parametrize("report_to", [["tensorboard"], ["all"]])
def test_a_tensorboard_too_old_for_numpy_2_is_refused_before_anything_loads(monkeypatch, report_to):
    """tensorboard before 2.17.1 reads np.string_, gone in numpy 2, when a run stores its config: after the model
    and the data are loaded, in a traceback. The check reads the installed versions alone."""
    import importlib.metadata

    installed = {"tensorboard": "2.16.2", "numpy": "2.0.2"}
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed.get(name) or real(name))
    with pytest.raises(ConfigError) as info:
        check_trackers(report_to)
    assert str(info.value) == ("logging.report_to: tensorboard 2.16.2 does not run beside numpy 2.0.2 "
                               "(pip install 'tensorboard>=2.17.1')")
    for tensorboard, numpy in (("2.17.1", "2.0.2"), ("2.16.2", "1.26.4"), ("2.20.0rc1", "2.3.0")):
        installed.update(tensorboard=tensorboard, numpy=numpy)
        check_trackers(report_to)  # the release that runs beside numpy 2, or numpy 1
    installed.update(tensorboard="2.16.2", numpy="2.0.2")
    check_trackers([])  # not asked for: not checked


def test_missing_package_names_the_key_and_the_pip_package():
    name = missing_tracker()
    with pytest.raises(ConfigError) as info:
        check_trackers(["tensorboard", name])
    package = {"comet_ml": "comet-ml", "aim": "'aim<4'"}.get(name, name)
    assert str(info.value) == (f"logging.report_to: tracker {name!r} needs a package that is not installed "
                               f"(pip install {package})")


def test_missing_tracker_stops_train_py_before_any_work(tmp_path):
    name = missing_tracker()
    out = tmp_path / "out"
    cfg = {
        "model": {"name_or_path": str(save_tiny_model(tmp_path / "tiny-bert"))},
        "data": {"train_file": str(write_tsv(tmp_path / "sms.tsv", make_texts(40, seed=1))), "format": "tsv",
                 "has_header": False, "column_names": ["label", "text"], "max_length": 32},
        "logging": {"report_to": ["tensorboard"], "progress_bar": False},
        "output": {"output_dir": str(out)},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    proc = forked.run([sys.executable, "finetune/train.py", "--config", str(tmp_path / "cfg.yaml"),
                       f"logging.report_to=[tensorboard,{name}]"], env=offline_env(), timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"logging.report_to: tracker {name!r} needs a package" in errors[0]
    assert not out.exists()  # nothing was written, no data was read into the output
