"""A user's own data on the first try: the default config plus the file and its two columns.

Each test starts from ``configs/default.yaml`` (the SMS file's layout travels
with its ``data.train_file`` mapping) and overrides only the data file, its
text and label columns and the output folder, plus the tiny model and a short
run so the suite stays fast.
"""

from __future__ import annotations

import csv
import json
import logging

import pytest

from finetune.config import DEFAULT_CONFIG, load_config
from finetune.errors import ConfigError
from helpers import REPO, make_texts, save_tiny_model
from tiny_run import reset_accelerate


def _write(path, fmt: str, rows):
    """``rows`` of (label, text) as a file of format ``fmt`` with columns ``sentence`` and ``sentiment``."""
    if fmt in ("csv", "tsv"):
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, delimiter="," if fmt == "csv" else "\t")
            writer.writerow(["id", "sentence", "sentiment"])
            writer.writerows([(i, text, label) for i, (label, text) in enumerate(rows)])
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"sentence": t, "sentiment": label}) + "\n" for label, t in rows),
                        encoding="utf-8")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"sentence": [t for _, t in rows], "sentiment": [label for label, _ in rows]}), path)
    else:  # a folder of class sub-folders
        for i, (label, text) in enumerate(rows):
            (path / label).mkdir(parents=True, exist_ok=True)
            (path / label / f"{i}.txt").write_text(text, encoding="utf-8")
    return path


def _train(tmp_path, overrides, config=None):
    from finetune import fit, setup_run

    cfg = load_config(config, overrides)
    reset_accelerate()
    try:
        run = setup_run(cfg)
        return run, fit(run)
    finally:
        reset_accelerate()


@pytest.mark.parametrize("fmt, name", [("csv", "reviews.csv"), ("tsv", "reviews.tsv"), ("jsonl", "reviews.jsonl"),
                                       ("parquet", "reviews.parquet"), ("folder", "reviews")])
def test_the_default_config_trains_on_a_users_file(tmp_path, fmt, name):
    data = _write(tmp_path / name, fmt, make_texts(60, seed=1))
    model = save_tiny_model(tmp_path / "model")
    columns = [] if fmt == "folder" else ["data.text_column=sentence", "data.label_column=sentiment"]
    run, summary = _train(tmp_path, [f"data.train_file={data}", *columns, f"output.output_dir={tmp_path / 'out'}",
                                     f"model.name_or_path={model}", "data.max_length=32", "training.max_steps=3"])
    assert summary["train"]["updates"] == 3
    assert summary["labels"] == ["ham", "spam"]
    # two classes: binary F1 of the rarer one, without being told
    assert run.cfg.evaluation.average == "binary" and run.cfg.evaluation.positive_label == "spam"
    assert 0.0 <= summary["eval"]["f1"] <= 1.0
    saved = (tmp_path / "out" / "config.yaml").read_text(encoding="utf-8")
    assert "positive_label: spam" in saved and "column_names: null" in saved


def test_the_short_command_trains_on_a_csv_into_a_folder_named_for_it(tmp_path, monkeypatch):
    from finetune.cli import main

    data = _write(tmp_path / "reviews.csv", "csv", make_texts(60, seed=2))
    model = save_tiny_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "outputs" / "reviews"  # no --output: named for the file, not for the default config's data
    reset_accelerate()
    try:
        code = main(["train", "--data", str(data), "--text", "sentence", "--label", "sentiment", "--model", str(model),
                     "data.max_length=32", "training.max_steps=2", "logging.progress_bar=false"])
    finally:
        reset_accelerate()
    assert code == 0
    assert not (tmp_path / "outputs" / "sms_spam").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train"]["updates"] == 2 and metrics["labels"] == ["ham", "spam"]
    assert load_config(out / "config.yaml").model.name_or_path == str(model)  # --model trained that model


@pytest.mark.slow
def test_a_hub_model_id_trains_from_the_hub_cache_offline(tmp_path):
    # `--model org/name` takes the Hub's code path: the id is looked up, not a folder; offline, transformers
    # reads it from the Hub cache, laid out here as huggingface_hub lays it out
    import shutil
    import subprocess
    import sys

    from helpers import offline_env

    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-bert" / "snapshots" / "0123abcd"
    shutil.copytree(save_tiny_model(tmp_path / "model"), snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd", encoding="utf-8")
    data = _write(tmp_path / "reviews.csv", "csv", make_texts(40, seed=5))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "train", "--data", str(data), "--text", "sentence",
                           "--label", "sentiment", "--model", "tiny-org/tiny-bert", "--output", str(out),
                           "data.max_length=32", "training.max_steps=2", "logging.progress_bar=false"],
                          cwd=tmp_path, env=offline_env({"HF_HUB_CACHE": str(tmp_path / "hub")}), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "start: fine-tune tiny-org/tiny-bert (new head)" in proc.stderr
    assert load_config(out / "config.yaml").model.name_or_path == "tiny-org/tiny-bert"
    assert "base_model: tiny-org/tiny-bert" in (out / "README.md").read_text(encoding="utf-8")  # the card's Hub id
    # a Hub id that is not in the cache is one line, offline as online
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "train", "--data", str(data), "--text", "sentence",
                           "--label", "sentiment", "--model", "tiny-org/absent", "--output", str(tmp_path / "x")],
                          cwd=tmp_path, env=offline_env({"HF_HUB_CACHE": str(tmp_path / "hub")}), capture_output=True,
                          text=True, timeout=300)
    error, hint = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and error.startswith(
        "error: command line: model.name_or_path: cannot load a tokenizer from tiny-org/absent: "), proc.stderr
    assert hint == "hint: 'tiny-org/absent' is not a local path, so it was taken as a Hugging Face Hub id"


def _classifier_answering_spam(directory, id2label: dict[int, str]):
    """A tiny BERT classifier trained, as it were, for ``id2label``, whose head answers "spam" whatever the text."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from helpers import tiny_bert_config

    model = BertForSequenceClassification(tiny_bert_config(len(id2label)))
    model.config.id2label, model.config.label2id = id2label, {name: i for i, name in id2label.items()}
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([8.0 if id2label[i] == "spam" else 0.0 for i in range(2)]))
    AutoTokenizer.from_pretrained(save_tiny_model(directory.parent / "encoder")).save_pretrained(directory)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("head", [{0: "spam", 1: "ham"}, {0: "ham", 1: "spam"}])
def test_a_classifier_continued_on_its_own_labels_keeps_each_outputs_class(tmp_path, head):
    """A head trained as ``{0: spam, 1: ham}`` and continued on data labelled ham and spam took each output for the
    other class (the data's ids are sorted): every prediction inverted before the first update. The ids now take
    the head's order, so the run starts from the model as it was, and the fine-tuned model keeps its ids."""
    import torch

    from finetune import setup_run

    model = _classifier_answering_spam(tmp_path / "spam-classifier", head)
    data = _write(tmp_path / "reviews.csv", "csv", make_texts(40, seed=5))
    cfg = load_config(None, [f"model.name_or_path={model}", f"data.train_file={data}", "data.text_column=sentence",
                             "data.label_column=sentiment", f"output.output_dir={tmp_path / 'out'}",
                             "data.max_length=32"])
    reset_accelerate()
    try:
        run = setup_run(cfg)
        assert run.labels.names == list(head.values())
        batch = next(iter(run.eval_dataloader))
        with torch.no_grad():
            logits = run.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        assert {run.model.config.id2label[int(i)] for i in logits.argmax(-1)} == {"spam"}  # as it answered
    finally:
        reset_accelerate()


def test_the_classes_a_models_head_was_trained_for_are_read_from_its_config():
    from transformers import BertConfig

    from finetune.modeling import trained_head_labels

    def config(architecture, id2label, **kwargs):
        return BertConfig(architectures=[architecture], id2label=id2label, **kwargs)

    assert trained_head_labels(config("BertForSequenceClassification", {0: "spam", 1: "ham"})) == ["spam", "ham"]
    assert trained_head_labels(config("BertModel", {0: "spam", 1: "ham"})) is None  # an encoder: a new head
    assert trained_head_labels(config("BertForSequenceClassification", {0: "LABEL_0", 1: "LABEL_1"})) is None
    assert trained_head_labels(config("BertForSequenceClassification", {0: "score"},
                                      problem_type="regression")) is None


@pytest.mark.parametrize("argv, output", [
    (["--data", "data/reviews.csv"], "outputs/reviews"),
    (["--data", "reviews/"], "outputs/reviews"),  # a class folder
    (["--data", "reviews.csv.gz"], "outputs/reviews"),  # named for the file the compressed one holds
    (["--data", "reviews.csv", "--output", "mine"], "mine"),
    (["--data", "reviews.csv", "output.output_dir=mine"], "mine"),
    # a shipped config's folder is named for its own data set (outputs/bbc_news), which --data replaced
    (["--data", "reviews.csv", "--config", str(REPO / "configs" / "bbc_news.yaml")], "outputs/reviews"),
    (["--data", "reviews.csv", "--config", "{own}"], None),  # a config of one's own names its folder
    ([], None),
    (["training.seed=3"], None),
    # the data replaced by a setting instead of --data: a second data set would meet the first one's run
    (["data.train_file=data/reviews.csv"], "outputs/reviews"),
    (["data.dataset_name=glue", "data.dataset_config=sst2", "--text", "sentence"], "outputs/glue-sst2"),
    (["data.dataset_name=stanfordnlp/imdb"], "outputs/imdb"),
    (["--config", str(REPO / "configs" / "bert_base_sst2.yaml"), "data.dataset_config=cola"], "outputs/cola"),
    (["data.dataset_name=imdb", "--output", "mine"], "mine"),
    (["data.dataset_name=null"], None),
    (["data.dataset_name={a:b}"], None),  # refused by the config's checks, in their one line, not here
    (["data.dataset_name=imdb", "--config", "{own}"], None),
])
def test_data_on_a_shipped_config_writes_to_a_folder_named_for_the_data(argv, output, tmp_path):
    from finetune.train import parse_args

    own = tmp_path / "bbc_news.yaml"  # a copy, edited or not, is one's own
    own.write_text((REPO / "configs" / "bbc_news.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    argv = [str(own) if a == "{own}" else a for a in argv]
    outputs = [o.split("=", 1)[1] for o in parse_args(argv).overrides if o.startswith("output.output_dir=")]
    assert outputs == ([output] if output else [])


def test_a_sweep_takes_the_data_flags_of_train():
    from finetune.sweep import parse_args

    args = parse_args(["--data", "reviews.csv", "--text", "sentence", "--text-pair", "reply", "--label", "sentiment",
                       "--output", "sw", "training.seed=3"])
    assert args.overrides == ["data.train_file=reviews.csv", "data.text_column=sentence",
                              "data.text_pair_column=reply", "data.label_column=sentiment",
                              "output.output_dir=outputs/reviews", "training.seed=3"]
    assert args.output == "sw"  # the sweep's own folder


def test_train_and_score_take_the_second_text_of_a_pair_by_a_flag():
    from finetune.score import parse_args as score_args
    from finetune.train import parse_args as train_args

    assert train_args(["--data", "nli.csv", "--text", "premise", "--text-pair", "hypothesis", "--output", "o"]
                      ).overrides == ["data.train_file=nli.csv", "data.text_column=premise",
                                      "data.text_pair_column=hypothesis", "output.output_dir=o"]
    assert score_args(["o", "--file", "test.csv", "--text-pair", "hypothesis"]).overrides == [
        "data.text_pair_column=hypothesis"]


@pytest.mark.parametrize("command", ["train", "sweep"])
@pytest.mark.parametrize("args, line", [
    # the Trainer's arguments and transformers' example scripts': the setting that does their work
    (["--num_train_epochs", "3"], "--num_train_epochs: not an option of finetune {command}; the setting is "
                                  "training.num_train_epochs: write training.num_train_epochs=3"),
    (["--learning_rate=2e-5"], "--learning_rate: not an option of finetune {command}; the setting is "
                               "optim.learning_rate: write optim.learning_rate=2e-5"),
    (["--bf16"], "--bf16: not an option of finetune {command}; the setting is training.mixed_precision: write "
                 "training.mixed_precision=bf16"),
    (["--lr", "3e-5"], "--lr: not an option of finetune {command}; the setting is optim.learning_rate: write "
                       "optim.learning_rate=3e-5"),
    (["--max_seq_length", "256"], "--max_seq_length: not an option of finetune {command}; the setting is "
                                  "data.max_length: write data.max_length=256"),
    # a switch is written true; a strategy's "steps" or "epoch" is a count of updates here
    (["--overwrite_output_dir"], "--overwrite_output_dir: not an option of finetune {command}; the setting is "
                                 "output.overwrite: write output.overwrite=true"),
    (["--eval_strategy", "epoch"], "--eval_strategy: not an option of finetune {command}; the setting is "
                                   "evaluation.eval_every: write evaluation.eval_every=N"),
    # where the command has an option of its own for the setting, the line names it
    (["--model_name_or_path", "bert-base-uncased"], "--model_name_or_path: not an option of finetune {command}; "
                                                    "write --model bert-base-uncased"),
    (["--train_file", "b.csv"], "--train_file: not an option of finetune {command}; write --data b.csv"),
    (["--text_pair_column", "b"], "--text_pair_column: not an option of finetune {command}; write --text-pair b"),
])
def test_another_tools_option_is_told_the_setting_that_does_its_work(command, args, line, capsys):
    from finetune.sweep import main as sweep
    from finetune.train import main as train

    assert {"train": train, "sweep": sweep}[command](["--data", "reviews.csv", *args, "training.seed=1"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {line.format(command=command)}"]


@pytest.mark.parametrize("command, argv, line", [
    # a command's own option mistyped: the option it is near, before argparse's check of a required one (--file)
    ("predict", ["out", "--treshold", "0.3", "a text"], "--treshold: not an option of finetune predict (did you mean "
                                                        "--threshold?)"),
    ("predict", ["out", "a text", "--batch_size", "4"], "--batch_size: not an option of finetune predict (did you "
                                                        "mean --batch-size?)"),
    ("score", ["out", "--fle", "test.csv"], "--fle: not an option of finetune score (did you mean --file?)"),
    ("plot", ["out", "--outptu", "c.png"], "--outptu: not an option of finetune plot (did you mean --output?)"),
    ("train", ["--confg", "c.yaml"], "--confg: not an option of finetune train (did you mean --config?)"),
    ("sweep", ["--trials-seeds", "3"], "--trials-seeds: not an option of finetune sweep (did you mean "
                                       "--trial-seeds?)"),
    ("predict", ["out", "-threshold", "0.3"], "-threshold: not an option of finetune predict (did you mean "
                                              "--threshold?)"),
    ("predict", ["out", "-hello"], "-hello: not an option of finetune predict"),  # nothing near: no guess
    # a setting's name mistyped as an option, nearer to it than to any option of the command
    ("train", ["--treshold", "0.3"], "--treshold: not an option of finetune train; did you mean the setting "
                                     "evaluation.threshold? write evaluation.threshold=0.3"),
    ("train", ["--droput", "0.2"], "--droput: not an option of finetune train; did you mean the setting "
                                   "model.dropout? write model.dropout=0.2"),  # not --output
    ("sweep", ["--validation_spli", "0.2"], "--validation_spli: not an option of finetune sweep; did you mean the "
                                            "setting data.validation_split? write data.validation_split=0.2"),
    ("sweep", ["--learning_rat", "1e-4"], "--learning_rat: not an option of finetune sweep; did you mean the setting "
                                          "optim.learning_rate? write optim.learning_rate=1e-4"),
])
def test_a_mistyped_option_is_told_the_one_it_is_near(command, argv, line, capsys):
    import finetune.plot
    import finetune.predict
    import finetune.score
    import finetune.sweep
    import finetune.train

    module = {"train": finetune.train, "sweep": finetune.sweep, "predict": finetune.predict, "score": finetune.score,
              "plot": finetune.plot}[command]
    try:
        code = module.main(argv)
    except SystemExit as stop:  # argparse's exit, from the parser of predict, score and plot
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: {line}"
    assert err[1:] in ([], [f"hint: finetune {command} --help lists its options"],
                       [f"hint: finetune {command} --help lists its options and every setting, given as "
                        "section.key=value"])


def test_what_argparse_reads_as_a_value_is_not_taken_for_a_mistyped_option():
    from finetune.predict import parse_args

    # a negative number, words with a space, a prefix of an option, anything after --
    args = parse_args(["out", "-1 star", "--thresh", "-0.5", "--", "-hello", "--treshold"])
    assert (args.texts, args.threshold) == (["-1 star", "-hello", "--treshold"], "-0.5")


@pytest.mark.parametrize("argv, hint", [
    (["--data", "reviews.csv", "--text", "sentence"], ["hint: the command comes first: finetune train --data "
                                                       "reviews.csv --text sentence"]),
    (["trian", "--data", "reviews.csv"], []),  # a command mistyped is told the command, not train's options
])
def test_a_command_line_without_its_command_is_told_where_it_goes(argv, hint, capsys):
    from finetune.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"error: unknown command {argv[0]!r}") and err[1:] == hint


def test_a_mistyped_option_of_the_command_itself_is_told_its_own_option(capsys):
    from finetune.cli import main

    assert main(["--verison"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --verison: not an option of finetune (did you mean "
                                                    "--version?)", "hint: finetune --help lists the commands"]


def test_the_command_says_its_version_and_runs_as_python_m_finetune(capsys):
    """``finetune --version`` prints the version pyproject.toml gives the package; ``python -m finetune`` is the same
    command where its script is not on the PATH (a notebook's ``!python -m finetune ...``)."""
    import re
    import sys

    import forked
    from finetune.cli import main
    from helpers import offline_env

    declared = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"finetune {declared}\n"
    as_module = forked.run([sys.executable, "-m", "finetune", "--version"], env=offline_env(), timeout=60)
    assert (as_module.returncode, as_module.stdout) == (0, f"finetune {declared}\n")
    unknown = forked.run([sys.executable, "-m", "finetune", "trian"], env=offline_env(), timeout=60)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: unknown command 'trian' (did you mean train?)")


def test_a_trainer_setting_this_package_does_another_way_is_told_that_way(capsys):
    from finetune.train import main

    assert main(["--data", "reviews.csv", "--do_predict"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --do_predict: not an option of finetune train",
        "hint: a test set is scored once, by the saved model after training: --test TEST (data.test_file; a finished "
        "run's model: finetune score OUTPUT_DIR --file TEST)"]
    # a script's --test_file is the option that sets data.test_file
    assert main(["--data", "reviews.csv", "--test_file", "test.csv"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --test_file: not an option of finetune train; write "
                                                    "--test test.csv"]
    with pytest.raises(ConfigError, match=r"output\.push_to_hub: unknown key \(the output folder is a Hub "
                                          r"repository as it stands: hf upload"):
        load_config(None, ["output.push_to_hub=true"])


def test_a_mistyped_data_file_is_told_the_names_near_it(tmp_path, capsys):
    from finetune.train import main

    reviews = _write(tmp_path / "reviews.csv", "csv", make_texts(10))
    (tmp_path / "reviews_old.csv").write_text("text,label\n", encoding="utf-8")
    assert main(["--data", str(tmp_path / "reveiws.csv"), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: command line: data.train_file: {tmp_path / 'reveiws.csv'} not found",
        f"hint: did you mean {reviews} or {tmp_path / 'reviews_old.csv'}?"]
    assert main(["--data", str(tmp_path / "tweets.csv"), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: command line: data.train_file: {tmp_path / 'tweets.csv'} not found"]  # nothing near it
    assert not (tmp_path / "out").exists()
    model = save_tiny_model(tmp_path / "tiny-bert")
    capsys.readouterr()
    assert main(["--data", str(reviews), "--model", str(tmp_path / "tiny-brt"), "--output",
                 str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: command line: model.name_or_path: model path not found: {tmp_path / 'tiny-brt'}",
        f"hint: did you mean {model}?"]


def test_an_option_nothing_knows_is_told_where_the_options_are(capsys):
    from finetune.train import main

    assert main(["--data", "reviews.csv", "--frobnicate", "3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --frobnicate: not an option of finetune train",
        "hint: finetune train --help lists its options and every setting, given as section.key=value"]
    with pytest.raises(ConfigError, match=r"override 'lr': expected section\.key, .* \(lr is optim\.learning_rate "
                                          r"here\)"):
        load_config(None, ["lr=3e-5"])


def test_an_override_of_the_file_drops_the_settings_of_the_old_one():
    sms = load_config(None, [])
    assert (sms.data.format, sms.data.has_header, sms.data.column_names) == ("tsv", False, ["label", "text"])
    mine = load_config(None, ["data.train_file=reviews.csv"])
    assert (mine.data.format, mine.data.has_header, mine.data.column_names) == ("auto", True, None)


@pytest.mark.parametrize("mapping, message", [
    ({"path": "a.csv", "delimiter": ";"}, "data.train_file.delimiter: unknown key"),
    ({"format": "csv"}, "data.train_file.path: required in a file mapping"),
])
def test_a_bad_file_mapping_is_one_line(mapping, message):
    from finetune.config import config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict({"data": {"train_file": mapping}})
    with pytest.raises(ConfigError, match="data.format: given both in data.train_file and in data"):
        config_from_dict({"data": {"train_file": {"path": "a.csv", "format": "csv"}, "format": "tsv"}})


def test_a_csv_of_tab_separated_lines_is_read_as_tsv(tmp_path, caplog):
    from finetune.config import DataConfig
    from finetune.data import load_splits

    path = tmp_path / "sms.csv"
    path.write_text("text\tlabel\n" + "".join(f"{t}, more\t{label}\n" for label, t in make_texts(30, seed=3)),
                    encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(DataConfig(train_file=str(path)), seed=0)
    assert labels.names == ["ham", "spam"]
    assert len(splits["train"]) + len(splits["validation"]) == 30
    assert any("read as TSV" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("config", ["default.yaml", "bbc_news.yaml", "bert_base_sst2.yaml"])
def test_max_steps_on_the_command_line_wins_over_the_files_epochs(config, caplog):
    with caplog.at_level(logging.INFO, logger="finetune"):
        cfg = load_config(REPO / "configs" / config, ["training.max_steps=5"])
    assert cfg.training.max_steps == 5 and cfg.training.num_train_epochs is None
    assert any("replaces training.num_train_epochs" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="either training.max_steps or training.num_train_epochs"):
        load_config(REPO / "configs" / config, ["training.max_steps=5", "training.num_train_epochs=1"])


@pytest.mark.parametrize("override, ks", [("training.gradient_accumulation_steps=2", [2, 2]),
                                          ("training.accumulation_schedule={0: 8, 4: 2}", [8, 2])])
def test_k_on_the_command_line_wins_over_the_files_effective_batch(override, ks, caplog):
    # the README's `finetune train --data ... training.accumulation_schedule=...` reads the default config,
    # whose effective_batch_size 32 would otherwise contradict the k that was typed
    from finetune.accumulation import resolve_batching

    with caplog.at_level(logging.INFO, logger="finetune"):
        cfg = load_config(DEFAULT_CONFIG, [override])
    batching = resolve_batching(cfg.training, num_processes=1)
    assert cfg.training.effective_batch_size is None
    assert [batching.k_at(epoch) for epoch in (0, 4)] == ks
    assert any("replaces training.effective_batch_size: 32" in r.getMessage() for r in caplog.records)
    # typed together, they must still agree
    with pytest.raises(ConfigError, match="contradicts effective_batch_size 32"):
        resolve_batching(load_config(DEFAULT_CONFIG, ["training.gradient_accumulation_steps=2",
                                                      "training.effective_batch_size=32"]).training, 1)


def test_an_effective_batch_on_the_command_line_wins_over_the_files_k(tmp_path):
    from finetune.accumulation import resolve_batching

    path = tmp_path / "k.yaml"
    path.write_text(DEFAULT_CONFIG.read_text(encoding="utf-8").replace(
        "effective_batch_size: 32", "gradient_accumulation_steps: 4"), encoding="utf-8")
    cfg = load_config(path, ["training.effective_batch_size=64"])
    assert cfg.training.gradient_accumulation_steps is None
    assert resolve_batching(cfg.training, num_processes=2).k_at(0) == 4  # 64 = 8 x 2 processes x 4
    # under per_device_train_batch_size: auto the effective batch is what chooses b and k: a k typed beside it
    # is refused, not taken over the file's effective batch
    with pytest.raises(ConfigError, match="k is derived from effective_batch_size"):
        load_config(DEFAULT_CONFIG, ["training.per_device_train_batch_size=auto", "training.gradient_accumulation_steps=2"])


def test_a_file_on_the_command_line_replaces_the_configs_hub_data_set_and_the_other_way_round(caplog):
    # `--config configs/bert_base_sst2.yaml --data mine.csv`: the BERT-base recipe on one's own file
    with caplog.at_level(logging.INFO, logger="finetune"):
        cfg = load_config(REPO / "configs" / "bert_base_sst2.yaml", ["data.train_file=mine.csv"])
    assert (cfg.data.train_file, cfg.data.dataset_name, cfg.data.dataset_config) == ("mine.csv", None, None)
    assert any("replaces data.dataset_name: glue, data.dataset_config: sst2" in r.getMessage() for r in caplog.records)
    # a Hub data set over the default config: its SMS file goes, and the layout that file's mapping gave
    cfg = load_config(DEFAULT_CONFIG, ["data.dataset_name=glue", "data.dataset_config=sst2"])
    assert (cfg.data.dataset_name, cfg.data.dataset_config, cfg.data.train_file) == ("glue", "sst2", None)
    assert (cfg.data.format, cfg.data.has_header, cfg.data.column_names) == ("auto", True, None)
    # both typed: one of them must go
    with pytest.raises(ConfigError, match="set only one of data.train_file and data.dataset_name"):
        load_config(DEFAULT_CONFIG, ["data.dataset_name=glue", "data.train_file=mine.csv"])


@pytest.mark.parametrize("config", ["default.yaml", "bbc_news.yaml"])  # bert_base_sst2 needs the Hub
def test_max_steps_on_a_shipped_config_makes_five_updates_on_a_schedule_of_five(tmp_path, config):
    # the shipped config's batching and schedule, on shorter texts and without checkpoints: what is under
    # test is how max_steps sizes the schedule, which neither changes
    run, summary = _train(tmp_path, ["training.max_steps=5", f"output.output_dir={tmp_path / 'out'}",
                                     "logging.progress_bar=false", "data.max_eval_samples=16", "data.max_length=48",
                                     "data.max_train_samples=400", "output.save_checkpoints=false"],
                          config=REPO / "configs" / config)
    assert run.plan.total_updates == 5 and summary["train"]["updates"] == 5
    assert run.scheduler.get_last_lr()[0] == 0.0  # the linear schedule ended at the last of the five
    records = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    lrs = [r["train/lr"] for r in records if "train/lr" in r]
    assert [r["step"] for r in records if "train/lr" in r] == [1, 2, 3, 4, 5]
    warmup = run.plan.warmup_updates
    assert lrs[:1] == [0.0] * min(1, warmup) and min(lrs[warmup:]) > 0  # warmup from 0; no end before the last


def test_a_bare_key_is_told_its_section():
    with pytest.raises(ConfigError, match=r"did you mean training.max_steps\?"):
        load_config(DEFAULT_CONFIG, ["max_steps=5"])


def test_auto_average_is_macro_beyond_two_classes_and_binary_on_the_rarer_of_two():
    from types import SimpleNamespace

    from finetune.metrics import resolve_average

    auto = SimpleNamespace(average="auto", positive_label=None)
    assert resolve_average(auto, ["a", "b", "c"], [5, 5, 1]) == ("macro", None)
    assert resolve_average(auto, ["ham", "spam"], [90, 10]) == ("binary", "spam")
    assert resolve_average(auto, ["neg", "pos"], [10, 90]) == ("binary", "neg")
    assert resolve_average(auto, ["neg", "pos"], [50, 50]) == ("macro", None)  # nothing makes one positive
    given = SimpleNamespace(average="auto", positive_label="pos")
    assert resolve_average(given, ["neg", "pos"], [10, 90]) == ("binary", "pos")
    explicit = SimpleNamespace(average="weighted", positive_label=None)
    assert resolve_average(explicit, ["neg", "pos"], [10, 90]) == ("weighted", None)


def test_bucket_padding_pads_every_micro_batch_to_one_of_a_few_lengths(tmp_path):
    """BucketPadding pads every micro-batch to one of its lengths (four here), whatever its longest text."""
    from transformers import AutoTokenizer

    from finetune.dataloaders import BucketPadding
    from helpers import save_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_model(tmp_path / "tiny"))
    collate = BucketPadding(tokenizer, max_length=128)
    assert collate.sizes == [32, 64, 96, 128]
    assert BucketPadding(tokenizer, max_length=100).sizes == [25, 50, 75, 100]
    features = [{"input_ids": list(range(5, 5 + n)), "attention_mask": [1] * n} for n in (3, 40, 17)]
    batch = collate(features)
    assert batch["input_ids"].shape == (3, 64)  # the longest, 40, fits in the bucket of 64
    assert batch["attention_mask"].sum(1).tolist() == [3, 40, 17]  # the texts themselves are unchanged
    lengths = {collate(features[:1] * 2)["input_ids"].shape[1] for features in
               ([{"input_ids": [5] * n, "attention_mask": [1] * n}] for n in range(1, 129))}
    assert lengths == {32, 64, 96, 128}


@pytest.mark.parametrize("multiple", [8, None])
def test_a_cpu_runs_micro_batches_padded_to_a_multiple_of_the_setting(tmp_path, multiple):
    """Padded to a multiple of 8 by default (fewer shapes for oneDNN to build kernels for); null pads each
    micro-batch, training and evaluation alike, to its longest text."""
    from finetune import setup_run
    from tiny_run import tiny_config

    cfg = tiny_config(tmp_path, data={"pad_to_multiple_of": multiple})
    reset_accelerate()
    try:
        run = setup_run(cfg)
        batches = [*run.train_dataloader, *run.eval_dataloader]
    finally:
        reset_accelerate()
    lengths = [batch["input_ids"].shape[1] for batch in batches]
    longest = [int(batch["attention_mask"].sum(1).max()) for batch in batches]
    assert any(n % 8 for n in longest)  # texts whose lengths are not multiples of 8 already
    if multiple is None:
        assert lengths == longest
    else:
        assert lengths == [-(-n // multiple) * multiple for n in longest]


@pytest.mark.parametrize("command", ["train", "predict", "score", "plot", "sweep"])
def test_each_commands_help_names_the_command_a_user_types(command, capsys):
    from finetune.cli import COMMANDS, main

    assert command in COMMANDS
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: finetune {command} ")


def test_the_data_options_help_names_every_format_a_run_reads(capsys):
    """``--data``'s help is where a user looks for what their file may be: each format the readers take by its
    extension is named there (a workbook once was not)."""
    from finetune.resources import EXTENSIONS, WORKBOOKS
    from finetune.train import main

    with pytest.raises(SystemExit):
        main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    options = said[said.index("options:"):]
    data = options[options.index("--data FILE"):options.index("--validation FILE")]
    named = {"csv": "CSV", "tsv": "TSV", "json": "JSON Lines", "parquet": "Parquet", "excel": "Excel workbook (.xlsx"}
    assert set(named) == {*EXTENSIONS.values(), *WORKBOOKS.values()}  # a new format gets its name here
    assert [fmt for fmt, name in named.items() if name not in data] == []
