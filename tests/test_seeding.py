"""``training.seed`` fixes the dropout stream, whatever setup drew from the generators before training."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import finetune.modeling
from tiny_run import fit_tiny_run

# dropout on, so the weights depend on the global generator's state when training starts
SECTIONS = {"model": {"dropout": 0.3}, "training": {"num_train_epochs": 1}}


def _final_weights(root, monkeypatch, draws_in_setup: int = 0, draws_before_fit: int = 0) -> dict:
    original = finetune.modeling.load_model

    def load_and_draw(*args, **kwargs):
        model = original(*args, **kwargs)
        torch.rand(draws_in_setup)  # as a head with more labels, or another architecture's, would
        return model

    monkeypatch.setattr(finetune.modeling, "load_model", load_and_draw)
    cfg, _ = fit_tiny_run(root, before_fit=lambda run: torch.rand(draws_before_fit), **SECTIONS)
    return load_file(f"{cfg.output.output_dir}/model.safetensors")


def test_dropout_stream_does_not_depend_on_what_setup_drew(tmp_path, monkeypatch):
    reference = _final_weights(tmp_path / "reference", monkeypatch)
    more_draws_in_setup = _final_weights(tmp_path / "setup", monkeypatch, draws_in_setup=1000)
    # Control: the same draws once setup is done do shift the dropout masks, and so the weights;
    # without the re-seed at the end of setup the first comparison would differ the same way.
    more_draws_after_setup = _final_weights(tmp_path / "after", monkeypatch, draws_before_fit=1000)

    assert reference.keys() == more_draws_in_setup.keys()
    for name in reference:
        assert torch.equal(reference[name], more_draws_in_setup[name]), name
    assert any(not torch.equal(reference[name], more_draws_after_setup[name]) for name in reference)
