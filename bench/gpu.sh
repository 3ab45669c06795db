#!/usr/bin/env bash
# The GPU check in one command, on a CUDA machine (no network needed):
#
#   bench/gpu.sh [OUT_DIR]          # default bench/results/gpu; also: make gpu-check
#
# 1. The tests marked `gpu` (tests/test_gpu.py): the accumulation contract on CUDA in fp32, a
#    bf16 run, fp16 with the grad scaler (a skipped step does not advance the schedule), fused
#    AdamW, and DDP over NCCL when there are two GPUs or more.
# 2. The speed comparison against transformers.Trainer and an Accelerate loop on a bert-base-sized
#    model (random weights, the embedded tokenizer: bench/bert_base.py) at max_length 128 in bf16,
#    on BBC News: samples/s, non-pad tokens/s, peak GPU memory, MFU against the matmul peak
#    measured on that GPU, and (b, k) against (b, 1) and (b*k, 1).
#
# Settings: GPU_BATCHING=b,k (default 64,4), GPU_STEPS (updates per run, default 40),
# GPU_REPEATS (default 3), FINETUNE_TOKENIZER=<folder> to use another tokenizer than the
# embedded MiniLM's. bench/README.md ("On a GPU") lists the wheels to bring to an offline machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'bench/gpu.sh: no CUDA GPU here'; print('gpu:', torch.cuda.get_device_name(), torch.__version__)"
python -m pytest -m gpu -v -rs -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu-tests.log"
python -m bench.bert_base "$out/bert-base" ${FINETUNE_TOKENIZER:+--tokenizer "$FINETUNE_TOKENIZER"}
python bench/run.py --datasets bbc --accuracy-seeds 0 --skip-grad-check --precision bf16 \
    --batching "${GPU_BATCHING:-64,4}" --bbc-steps "${GPU_STEPS:-40}" --repeats "${GPU_REPEATS:-3}" \
    --override model.name_or_path="$out/bert-base" --override data.max_length=128 --out "$out/bench"
cat "$out/bench/bench.md"
