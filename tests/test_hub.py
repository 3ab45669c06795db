"""An unreachable Hugging Face Hub: one quick request says so, and a Hub id is read from the local cache alone.

The Hub here is a port of this machine: closed (no answer at all), or served by a small HTTP server that answers
404 (an answer: the Hub is there). Nothing leaves the machine.
"""

from __future__ import annotations

import http.server
import sys
import threading

import pytest

from helpers import free_port, make_texts, run_cli, save_tiny_model, tsv_train_file, write_tsv

# what lets the runs below ask the Hub at all: the suite's environment turns offline mode on
ONLINE = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
REPO_ID = "someone/tiny-bert"


@pytest.fixture
def hub_endpoint(monkeypatch):
    """Point huggingface_hub at ``http://127.0.0.1:PORT`` with offline mode off; returns a setter for the port."""
    from huggingface_hub import constants

    from finetune import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    _new_hub_sessions()
    hub.unreachable.cache_clear()

    def point_at(port: int) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
        hub.unreachable.cache_clear()  # asked once per id and process: a new endpoint is a new question

    yield point_at
    hub.unreachable.cache_clear()
    _new_hub_sessions()


def _new_hub_sessions() -> None:
    """huggingface_hub before 1.0 builds its HTTP session once per process, refusing every request where offline
    mode was on then: the next request builds one under the setting of the moment."""
    from huggingface_hub import utils

    reset = getattr(utils, "reset_sessions", None)
    if reset is not None:
        reset()


def test_no_answer_is_unreachable_and_any_answer_is_not(hub_endpoint):
    from finetune import hub

    hub_endpoint(free_port())  # nothing listens there
    why = hub.unreachable(REPO_ID)
    assert why is not None and why.strip()

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub_endpoint(server.server_address[1])
        # a refusal is an answer: the loaders' own errors say what was refused (a repository not found, gated)
        assert hub.unreachable(REPO_ID) is None
        assert hub.unreachable("someone/a-data-set", "dataset") is None
        assert hub.model_options(REPO_ID) == {}
    finally:
        server.shutdown()


def test_offline_mode_asks_nothing(monkeypatch):
    from huggingface_hub import HfApi, constants

    from finetune import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(HfApi, "model_info", lambda *a, **k: pytest.fail("the Hub was asked in offline mode"))
    hub.unreachable.cache_clear()
    assert hub.unreachable(REPO_ID) is None and hub.model_options(REPO_ID) == {}
    hub.unreachable.cache_clear()


def test_the_adapter_look_up_is_told_the_cache_only_where_transformers_does_not_tell_it(monkeypatch):
    """Unreachable, a model class's ``from_pretrained`` reads the cache only: transformers 5 passes its adapter
    look-up nothing but ``adapter_kwargs``, transformers 4 passes it ``local_files_only`` itself, where a second
    one from ``adapter_kwargs`` is a TypeError (a Hub id in the cache could not be loaded offline)."""
    from finetune import hub

    monkeypatch.setattr(hub, "unreachable", lambda *a: "no route to host")
    said = []
    monkeypatch.setattr(hub, "say_once", said.append)
    for major, adapter in ((5, {"adapter_kwargs": {"local_files_only": True}}), (4, {})):
        monkeypatch.setattr(hub, "transformers_major", lambda: major)
        assert hub.model_options(REPO_ID, weights=True) == {"local_files_only": True, **adapter}
        assert hub.model_options(REPO_ID) == {"local_files_only": True}  # a tokenizer or a config: no adapter
    # the look-up transformers 4 cannot be told about is named, with what it costs and what skips it
    cache_only = (f"the Hugging Face Hub cannot be reached (no route to host): {REPO_ID} is read from the local "
                  "cache only (HF_HUB_OFFLINE=1 skips this check)")
    assert said == [cache_only] * 2 + [cache_only + "; transformers 4 may still ask it for an adapter of the model "
                                       "(a cache filled by `hf download`): half a minute of retries that "
                                       "HF_HUB_OFFLINE=1 skips"] * 2
    monkeypatch.undo()
    import transformers

    assert hub.transformers_major() == int(transformers.__version__.split(".")[0])


def test_a_local_path_is_never_looked_up(monkeypatch, tmp_path):
    from finetune import hub

    monkeypatch.setattr(hub, "unreachable", lambda *a: pytest.fail("a local path was looked up on the Hub"))
    assert hub.model_options(str(tmp_path)) == {}
    assert hub.offline_reason(str(tmp_path)) is None


def _train(tmp_path, hf_home, model: str):
    data = write_tsv(tmp_path / "train.tsv", make_texts(40))
    env = {**ONLINE, "HF_HOME": str(hf_home), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    return run_cli([f"model.name_or_path={model}", tsv_train_file(data), "data.max_length=32", "training.max_steps=1",
                    "training.per_device_train_batch_size=8", "training.effective_batch_size=8",
                    "logging.progress_bar=false", f"output.output_dir={tmp_path / 'out'}"],
                   env=env, launcher=[sys.executable], timeout=120)


def _no_retries(proc) -> bool:
    return "Retrying in" not in proc.stderr and "thrown while requesting" not in proc.stderr


def test_a_hub_id_not_in_the_cache_fails_at_once_when_the_hub_is_unreachable(tmp_path):
    proc = _train(tmp_path, tmp_path / "hf", REPO_ID)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-2:]
    assert last[0].startswith(f"error: command line: model.name_or_path: cannot load a tokenizer from {REPO_ID}: "
                              "not in the local Hugging Face cache, and the Hub cannot be reached ("), last
    assert last[1] == f"hint: '{REPO_ID}' is not a local path, so it was taken as a Hugging Face Hub id"
    assert _no_retries(proc), proc.stderr  # huggingface_hub's retries, a minute of them, were skipped
    assert not (tmp_path / "out").exists()


def test_a_hub_id_in_the_cache_trains_when_the_hub_is_unreachable(tmp_path):
    # the cache's documented layout: models--<org>--<name>/refs/main names the snapshot that holds the files
    cached = tmp_path / "hf" / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    revision = "0" * 40
    save_tiny_model(cached / "snapshots" / revision)
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text(revision)
    proc = _train(tmp_path, tmp_path / "hf", REPO_ID)
    assert proc.returncode == 0, proc.stderr
    assert ("the Hugging Face Hub cannot be reached (" in proc.stderr
            and f"): {REPO_ID} is read from the local cache only (HF_HUB_OFFLINE=1 skips this check)" in proc.stderr)
    assert proc.stderr.count("cannot be reached") == 1  # said once, for the tokenizer, the config and the weights
    from finetune.hub import transformers_major

    if transformers_major() >= 5:
        assert _no_retries(proc), proc.stderr
    else:  # transformers 4's Auto class looks for an adapter with arguments the package cannot give, where the
        # cache, as `hf download` fills it, has no note of the adapter's absence: the warning says so
        asked = [line for line in proc.stderr.splitlines() if "thrown while requesting" in line]
        assert asked and all(line.endswith("/adapter_config.json") for line in asked), asked
        assert "transformers 4 may still ask it for an adapter of the model" in proc.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_hub_data_set_that_cannot_be_loaded_says_the_hub_was_unreachable(monkeypatch, caplog):
    import datasets

    from finetune import data, hub
    from finetune.config import DataConfig
    from finetune.errors import DataError

    monkeypatch.setattr(hub, "unreachable", lambda repo_id, repo_type="model": "[Errno -2] Name or service not known")

    def unreadable(name, config):
        raise FileNotFoundError(f"{name}: no arrow file for {config}")

    monkeypatch.setattr(datasets, "load_dataset", unreadable)
    with pytest.raises(DataError) as caught:
        data._load_hub(DataConfig(dataset_name="glue", dataset_config="sst2"))
    assert str(caught.value) == ("data.dataset_name: cannot load 'glue/sst2': the Hub cannot be reached ([Errno -2] "
                                 "Name or service not known), and the local cache did not serve it: "
                                 "FileNotFoundError: glue: no arrow file for sst2")
    assert caught.value.hint == "give the data as a file instead (--data)"
    assert "glue/sst2 is read from datasets' local cache only (HF_HUB_OFFLINE=1 skips this check)" in caplog.text



def _cache_as_hub_data_set(hf_home, repo_id: str, rows: list[tuple[str, str]]) -> None:
    """``repo_id`` in datasets' cache as a download from the Hub leaves it: built by datasets' own Parquet
    builder, then laid out as ``<namespace>___<name>/<config>/<version>/<revision>/`` with its ``dataset_info.json``
    and one Arrow file per split."""
    import json

    import datasets

    build = hf_home / "build"
    build.mkdir(parents=True)
    labels, texts = zip(*rows)
    datasets.Dataset.from_dict({"text": list(texts), "label": list(labels)}).to_parquet(str(build / "train.parquet"))
    datasets.load_dataset("parquet", data_files={"train": str(build / "train.parquet")}, cache_dir=str(build / "cache"))
    built = next((build / "cache" / "parquet").glob("*/*/*/dataset_info.json")).parent
    namespace, name = repo_id.split("/")
    cached = hf_home / "datasets" / f"{namespace}___{name}" / "default" / "0.0.0" / ("0" * 40)
    cached.mkdir(parents=True)
    info = json.loads((built / "dataset_info.json").read_text())
    (cached / "dataset_info.json").write_text(json.dumps({**info, "dataset_name": name}))
    (cached / f"{name}-train.arrow").write_bytes((built / "parquet-train.arrow").read_bytes())


def _train_on_hub_data(tmp_path, hf_home, repo_id: str):
    model = save_tiny_model(tmp_path / "tiny-bert")
    env = {**ONLINE, "HF_HOME": str(hf_home), "HF_DATASETS_CACHE": str(hf_home / "datasets"),
           "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    return run_cli([f"model.name_or_path={model}", f"data.dataset_name={repo_id}", "data.max_length=32",
                    "training.max_steps=1", "training.per_device_train_batch_size=8",
                    "training.effective_batch_size=8", "logging.progress_bar=false",
                    f"output.output_dir={tmp_path / 'out'}"], env=env, launcher=[sys.executable], timeout=120)


def test_a_hub_data_set_in_the_cache_trains_at_once_when_the_hub_is_unreachable(tmp_path):
    _cache_as_hub_data_set(tmp_path / "hf", "someone/sms", make_texts(40))
    proc = _train_on_hub_data(tmp_path, tmp_path / "hf", "someone/sms")
    assert proc.returncode == 0, proc.stderr
    assert ("the Hugging Face Hub cannot be reached (" in proc.stderr and "): someone/sms is read from datasets' "
            "local cache only (HF_HUB_OFFLINE=1 skips this check)" in proc.stderr)
    assert _no_retries(proc), proc.stderr  # datasets' own, half a minute of them, were skipped
    assert "for 2 classes (ham, spam) on someone/sms: 36 train rows" in proc.stderr  # the cached 40, less validation


def test_a_hub_data_set_not_in_the_cache_fails_at_once_when_the_hub_is_unreachable(tmp_path):
    proc = _train_on_hub_data(tmp_path, tmp_path / "hf", "someone/elsewhere")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("error: command line: data.dataset_name: cannot load 'someone/elsewhere': not in "
                              "datasets' local cache, and the Hub cannot be reached ("), last
    assert last[1] == "hint: give the data as a file instead (--data)"
    assert _no_retries(proc), proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("env, speaks", [
    ({}, True),
    ({"RANK": "3"}, True),  # a cluster's job array sets a rank with no launch of several processes around it
    ({"WORLD_SIZE": "2", "RANK": "0"}, True),
    ({"WORLD_SIZE": "2", "RANK": "1"}, False),  # the first process speaks for the others
])
def test_a_hub_warning_is_said_by_the_process_that_speaks(monkeypatch, caplog, env, speaks):
    import logging

    from finetune import hub

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    message = f"a warning for {sorted(env.items())}"
    with caplog.at_level(logging.WARNING, logger="finetune"):
        hub.say_once(message)
        hub.say_once(message)  # once
    assert [r.getMessage() for r in caplog.records if r.name == "finetune"] == ([message] if speaks else [])
