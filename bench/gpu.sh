#!/usr/bin/env bash
# The GPU check in one command, on a CUDA machine (no network needed):
#
#   bench/gpu.sh [OUT_DIR [PART ...]]   # default bench/results/gpu, every part; also: make gpu-check
#
# The parts, run in this order, each also on its own (`bench/gpu.sh bench/results/gpu speed`, or
# `make gpu-check ARGS="bench/results/gpu speed"`): tests, speed, casts, graphs (1. to 4. below).
#
# 1. The tests marked `gpu`: the accumulation contract on CUDA in fp32, a bf16 run, fp16 with the
#    grad scaler (a skipped step does not advance the schedule), fused AdamW, DDP over NCCL when
#    there are two GPUs or more (tests/test_gpu.py); FSDP and DeepSpeed ZeRO-2 launched on one GPU
#    with the shipped configs: the contract, a stop and an exact resume, the saved model in
#    pipeline() (tests/test_gpu_engines.py; DeepSpeed's skipped where it is not installed);
#    training.cuda_graphs capturing real graphs: the eager weights, the warm-up adding nothing and
#    drawing no random numbers, gradients kept in place (tests/test_cuda_graphs.py).
# 2. The speed comparison against transformers.Trainer and an Accelerate loop on a bert-base-sized
#    model (random weights, the embedded tokenizer: bench/bert_base.py) at max_length 128 in bf16,
#    on BBC News: samples/s, non-pad tokens/s, peak GPU memory, MFU against the matmul peak
#    measured on that GPU, and (b, k) against (b, 1) and (b*k, 1); the package under FSDP (and
#    DeepSpeed, where installed) and with training.cuda_graphs as rows of the same table.
# 3. training.cast_once_per_update on against off on the same job: CUDA kernels, aten ops and
#    milliseconds per micro-batch (python -m bench.probe casts).
# 4. A micro-batch replayed from CUDA graphs against the eager one, on the same job: milliseconds per
#    micro-batch, the accumulated gradient's difference, the micro-batches after which capturing pays
#    for itself, and the graphs' memory pool (python -m bench.cuda_graphs).
#
# Settings: GPU_BATCHING=b,k (default 64,4), GPU_STEPS (updates per run, default 40),
# GPU_REPEATS (default 3), FINETUNE_TOKENIZER=<folder> to use another tokenizer than the
# embedded MiniLM's. bench/README.md ("On a GPU") lists the wheels to bring to an offline machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu}
[ $# -gt 0 ] && shift
parts=" ${*:-tests speed casts graphs} "
for part in $parts; do
    case $part in tests|speed|casts|graphs) ;; *) echo "bench/gpu.sh: no part '$part' (tests, speed, casts, graphs)" >&2; exit 2;; esac
done
wants() { [[ $parts == *" $1 "* ]]; }
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'bench/gpu.sh: no CUDA GPU here'; print('gpu:', torch.cuda.get_device_name(), torch.__version__)"
# a failing test or probe does not stop the measurements after it; the exit status reports it at the end
failed=""
if wants tests; then
    python -m pytest -m gpu -v -rs -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engines.py tests/test_cuda_graphs.py 2>&1 \
        | tee "$out/gpu-tests.log" || failed="$failed tests (see $out/gpu-tests.log)"
fi
if wants speed || wants casts || wants graphs; then
    [ -f "$out/bert-base/config.json" ] || python -m bench.bert_base "$out/bert-base" ${FINETUNE_TOKENIZER:+--tokenizer "$FINETUNE_TOKENIZER"}
fi
b_k=${GPU_BATCHING:-64,4}
if wants speed; then
    engines=fsdp
    python -c "import deepspeed" 2>/dev/null && engines=fsdp,deepspeed_zero2
    python bench/run.py --datasets bbc --accuracy-seeds 0 --skip-grad-check --precision bf16 \
        --batching "$b_k" --bbc-steps "${GPU_STEPS:-40}" --repeats "${GPU_REPEATS:-3}" --engines "$engines" --graphs \
        --override model.name_or_path="$out/bert-base" --override data.max_length=128 --out "$out/bench" \
        && cat "$out/bench/bench.md" || failed="$failed speed"
fi
if wants casts; then
    python -m bench.probe casts model.name_or_path="$out/bert-base" data.max_length=128 training.mixed_precision=bf16 \
        training.per_device_train_batch_size="${b_k%,*}" training.effective_batch_size="$(( ${b_k%,*} * ${b_k#*,} ))" \
        2>&1 | tee "$out/casts.md" || failed="$failed casts"
fi
if wants graphs; then
    python -m bench.cuda_graphs model.name_or_path="$out/bert-base" data.max_length=128 training.mixed_precision=bf16 \
        training.per_device_train_batch_size="${b_k%,*}" 2>&1 | tee "$out/cuda_graphs.md" || failed="$failed cuda_graphs"
fi
[ -z "$failed" ] || { echo "bench/gpu.sh: failed:$failed" >&2; exit 1; }
