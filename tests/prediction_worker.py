"""A Predictor that shares its batches among the processes launched; run under ``accelerate launch``.

``tests/test_prediction_processes.py`` launches it on two processes: each writes the batches its model ran and
the logits it got back, and the texts its tokenizer was given. Not a test module itself (pytest does not collect it).

Usage: ``prediction_worker.py OUT MODEL_DIR TEXTS_JSON`` (a batch of 2 texts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from finetune.predict import Predictor
from helpers import RecordingTokenizer  # beside this script, on its import path


if __name__ == "__main__":
    out, model_dir, texts = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    predictor = Predictor.load(model_dir, batch_size=2, across_processes=True)
    predictor.tokenizer = RecordingTokenizer(predictor.tokenizer)
    batches = []
    predictor.model.register_forward_hook(
        lambda module, args, kwargs, output: batches.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    logits = predictor.logits(texts)
    index, count = predictor.processes
    (out / f"process{index}.json").write_text(json.dumps({"processes": [index, count], "batches": batches,
                                                         "logits": logits.tolist(),
                                                         "tokenized": predictor.tokenizer.texts}))
