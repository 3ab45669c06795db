"""data.padding: every batch padded to data.max_length for the encoders that read the padding (finetune.truncation).

That this keeps the accumulation contract for each of them, and that padding to each micro-batch's longest text
does not, is tests/test_accumulation.py's; here: which models and settings pad to one length, that a run's
training and evaluation batches and its predictions are padded so, and what the start line says.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from helpers import PADDING_READERS, save_tiny_model, tiny_model
from tiny_run import fit_tiny_run, tiny_config, tiny_process

from finetune.errors import ConfigError
from finetune.truncation import READS_THE_PADDING, padding_for

MAX_LENGTH = 32  # tiny_config's data.max_length


def test_every_encoder_the_package_pads_to_one_length_is_one_the_tests_train():
    assert sorted(READS_THE_PADDING) == sorted(PADDING_READERS)


@pytest.mark.parametrize("model_type", [*PADDING_READERS, "bert", "roberta", "modernbert"])
def test_auto_pads_to_max_length_exactly_the_encoders_that_read_the_padding(model_type):
    config = tiny_model(model_type, num_labels=2).config
    reads = model_type in PADDING_READERS
    assert padding_for("auto", 128, config).length == (128 if reads else None)
    assert padding_for("max_length", 128, config).length == 128  # any model, asked
    assert padding_for("longest", 128, config).length is None  # any model, asked
    assert padding_for("auto", None, config).length is None  # no max_length: no one length to pad to
    assert (padding_for("longest", 128, config).caution() is not None) == reads
    assert padding_for("auto", 128, config).caution() is None
    assert (padding_for("auto", 128, config, longest=64).caution() is not None) == reads  # 128 is twice 64
    assert padding_for("auto", 128, config, longest=65).caution() is None
    assert padding_for("max_length", 128, config, longest=64).caution().startswith(
        "every batch is padded to data.max_length=128 tokens (data.padding=max_length), and the longest training "
        "text has 64: data.max_length=64 would compute 2.0x fewer tokens a batch")


def _batch_widths(run) -> tuple[set, set]:
    train = {batch["input_ids"].shape[1] for batch in run.train_dataloader}
    evaluation = {batch["input_ids"].shape[1] for batch in run.eval_dataloader}
    return train, evaluation


@pytest.mark.parametrize("model_type, padding, one_length, why", [
    ("convbert", "auto", True, "(auto: convbert reads the padding, its convolutions read the padded positions"),
    ("convbert", "longest", False, None),
    ("bert", "auto", False, None),
    ("bert", "max_length", True, "(data.padding)"),
])
def test_a_runs_batches_are_padded_as_its_setting_and_model_ask_and_its_start_line_says_so(
        tmp_path, model_type, padding, one_length, why):
    from finetune import setup_run
    from finetune.start_line import cautions, describe

    model = save_tiny_model(tmp_path / model_type, model_type=model_type)
    cfg = tiny_config(tmp_path, model={"name_or_path": str(model)}, data={"padding": padding})
    with tiny_process():
        run = setup_run(cfg)
        train, evaluation = _batch_widths(run)
        line, warned = describe(run), cautions(run)
    if one_length:
        assert train == evaluation == {MAX_LENGTH}
        assert f" padding={MAX_LENGTH} {why}" in line
        assert "micro-batches=equal" in line  # a balanced cut pads nothing less when every batch has one length
    else:
        assert len(train) > 1 and max(train) < MAX_LENGTH and max(evaluation) < MAX_LENGTH
        assert " padding=" not in line
        assert "micro-batches=balanced" in line
    readers_caution = [w for w in warned if "reads the padding" in w]
    if model_type == "convbert" and padding == "longest":
        assert readers_caution == [
            "convbert reads the padding (its convolutions read the padded positions beside a text), and "
            "data.padding=longest pads each batch to its longest text: (b, k)'s updates will be close to "
            "(b*k, 1)'s, not equal, and a text's predictions will depend on the texts batched with it; "
            "data.padding=auto pads every batch to data.max_length (docs/accumulation.md, which models keep it)"]
    else:
        assert readers_caution == []


def test_one_length_twice_the_longest_training_text_is_told_with_the_max_length_that_pads_less(tmp_path):
    from finetune import setup_run
    from finetune.start_line import cautions

    model = save_tiny_model(tmp_path / "convbert", model_type="convbert")
    cfg = tiny_config(tmp_path, model={"name_or_path": str(model)}, data={"max_length": 64})
    with tiny_process():
        run = setup_run(cfg)
        longest = max(len(ids) for ids in run.train_dataloader.dataset["input_ids"])
        warned = cautions(run)
    assert 2 * longest <= 64 and run.padding.longest == longest
    assert [w for w in warned if "data.max_length=" in w] == [
        f"every batch is padded to data.max_length=64 tokens (convbert reads the padding), and the longest training "
        f"text has {longest}: data.max_length={longest} would compute {64 / longest:.1f}x fewer tokens a batch "
        f"(longer validation or test texts cut there too)"]


def test_a_balanced_cut_asked_for_beside_one_length_is_refused_in_one_line(tmp_path):
    from finetune import setup_run

    model = save_tiny_model(tmp_path / "convbert", model_type="convbert")
    cfg = tiny_config(tmp_path, model={"name_or_path": str(model)}, data={"balance_micro_batches": True})
    with tiny_process(), pytest.raises(ConfigError, match=r"data.balance_micro_batches: true, but every "
                                                          rf"micro-batch is padded to {MAX_LENGTH} tokens \(data.padding\)"):
        setup_run(cfg)


@pytest.mark.parametrize("padding", ["auto", "longest"])
def test_a_texts_prediction_depends_on_its_batch_only_where_padded_to_its_longest(tmp_path, padding):
    from transformers import AutoTokenizer

    from finetune.predict import Predictor

    model = tiny_model("fnet", num_labels=2, dropout=0.0).eval()  # its Fourier transform mixes every position
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_model(tmp_path / "tiny-bert"))  # its WordPiece tokenizer
    predictor = Predictor(model, tokenizer, device="cpu", max_length=MAX_LENGTH, padding=padding)
    short, long = "hello you", " ".join(["free cash now"] * 8)
    alone = predictor.logits([short])[0]
    beside_a_long_text = predictor.logits([short, long])[0]
    if padding == "auto":
        np.testing.assert_allclose(beside_a_long_text, alone, rtol=0, atol=1e-6)
    else:
        assert np.abs(beside_a_long_text - alone).max() > 1e-5


def test_a_saved_run_predicts_padded_as_it_trained(tmp_path):
    from finetune.predict import Predictor

    model = save_tiny_model(tmp_path / "convbert", model_type="convbert")
    cfg, _ = fit_tiny_run(tmp_path, model={"name_or_path": str(model)}, training={"num_train_epochs": 1})
    out = cfg.output.output_dir
    assert Predictor.load(out, device="cpu").padded_to == MAX_LENGTH
    saved = tmp_path / "out" / "config.yaml"
    settings = yaml.safe_load(saved.read_text())
    settings["data"]["padding"] = "longest"
    saved.write_text(yaml.safe_dump(settings))
    assert Predictor.load(out, device="cpu").padded_to is None
