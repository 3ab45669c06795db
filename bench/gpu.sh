#!/usr/bin/env bash
# The GPU check in one command, on a CUDA machine (no network needed):
#
#   bench/gpu.sh [OUT_DIR [PART ...]]   # default bench/results/gpu, every part; also: make gpu-check
#
# The parts, in the order given (by default this one), each also on its own (`bench/gpu.sh bench/results/gpu speed`, or
# `make gpu-check ARGS="bench/results/gpu speed"`):
#
#   tests    the tests marked `gpu`, FSDP's and DeepSpeed's left to `engines`: the accumulation contract on
#            CUDA in fp32, a bf16 run, fp16 with the grad scaler (a skipped step does not advance the
#            schedule), fused AdamW, DDP over NCCL with two GPUs or more (tests/test_gpu.py);
#            training.cuda_graphs capturing real graphs: the eager weights, the warm-up adding nothing and
#            drawing no random numbers, gradients kept in place (tests/test_cuda_graphs.py), and launched
#            through the CLI: the contract, a stop and an exact resume, pipeline() (tests/test_gpu_engines.py)
#   speed    against transformers.Trainer on a bert-base-sized model (random weights, the embedded
#            tokenizer: bench/bert_base.py) at max_length 128 in bf16 on BBC News: samples/s, non-pad
#            tokens/s, peak GPU memory, MFU against the matmul peak measured on that GPU; the package at
#            (b, k) (its micro-batches replayed from CUDA graphs: training.cuda_graphs: auto), at (b, 1) and
#            eager (GPU_ARMS=all adds the Accelerate loop, (b*k, 1) and the package compiled and graphed)
#   host     where an update's time goes, in alternating rounds of eager steps, eager ones with blocking copies
#            of the micro-batches, micro-batches replayed from CUDA graphs, and from graphs of compiled blocks:
#            wall time against the GPU's kernel time, the host's waits for the GPU per update, the top kernels
#            and host ops of each way but the blocking copies (python -m bench.probe device)
#   graphs   a micro-batch replayed from CUDA graphs against the eager one, each also with the forward
#            compiled and with each encoder block compiled on its own (training.torch_compile: blocks):
#            milliseconds per micro-batch, the gradient's difference, the micro-batches after which
#            compiling and capturing pay, the graphs' memory pool; each way also with the encoder's biases added
#            apart from their products (python -m bench.cuda_graphs --compiled --bias-apart)
#   update   would capturing the update pay: the update (clipping, fused AdamW's step, zeroing) made eagerly as the
#            loop makes it, against launched before the host's read with the non-finite check on the device, and
#            replayed from one CUDA graph, each behind graphed micro-batches: milliseconds per update, the weights' difference, the skip of a NaN
#            (python -m bench.captured_update)
#   products an encoder layer's matrix products, each alone at the job's shapes: the linear layer's product with its
#            bias (addmm) against the product with the bias added apart and the product alone, and the backward's
#            two, and query, key and value as one product; each weight gradient added into fp32 as autograd
#            does (bf16 product, cast, add) against the product writing fp32 and against addmm accumulating in
#            its epilogue, with each way's error over k micro-batches: milliseconds and TFLOP/s, and an
#            update's sums (python -m bench.products); then again with DISABLE_ADDMM_CUDA_LT=1 (products-no-lt.md);
#            then a layer's attention, forward and backward, under each of torch's attention kernels, with and
#            without the mask and dropout: milliseconds, TFLOP/s, the difference from fp32 (python -m bench.attention)
#   casts    training.cast_once_per_update on against off: CUDA kernels, aten ops and milliseconds per
#            micro-batch (python -m bench.probe casts)
#   predict  finetune predict's --precision: texts per second in float32 and under bf16 and fp16 autocast, the
#            labels that agree with float32's, on BBC News texts (python -m bench.predict); then, on the default
#            job's messages in bf16, batches padded in the loop against by 4 DataLoader workers (--workers)
#   engines  FSDP and DeepSpeed ZeRO-2 launched on one GPU with the shipped configs: the contract, a stop
#            and an exact resume, pipeline() (tests/test_gpu_engines.py; DeepSpeed's skipped where it is not
#            installed), and the package under each against the Trainer (bench/run.py --engines, one
#            repeat)
#   compile  the package compiled and replayed from CUDA graphs, the whole forward (training.torch_compile:
#            true) and each block (blocks), against the Trainer and the uncompiled graphs over a longer run
#            (GPU_COMPILE_STEPS updates, default 120; one repeat), each run compiling into an empty cache:
#            the compile's cold start and the steady rate after it, so how long a run must be for each to pay
#   apart    training.attention_kernel=cudnn, training.gradient_accumulation_fusion, training.bias_apart, the
#            three together, the last two together, and DISABLE_ADDMM_CUDA_LT=1 in the environment, against
#            none, with compiled blocks first, then in the default (micro-batches replayed from CUDA graphs)
#            (GPU_COMPILE_STEPS updates, one repeat, empty caches): whether cuDNN's attention, weight gradients
#            added by their products, the products without their biases, or addmm kept off cuBLASLt, lift the
#            package's steady MFU in place
#   autotune compiled blocks with inductor's max-autotune (without its own graphs: the package captures) against
#            the default compile, both replayed from CUDA graphs, and the Trainer (GPU_COMPILE_STEPS updates, one
#            repeat, empty caches): whether autotuned matrix products and fused epilogues lift the steady MFU,
#            and what their longer compile costs (about 8 minutes on an H100: the autotuned arm's first epoch
#            alone takes 3)
#   tokenizing  not the GPU: the host's cores, more than a CPU runner has, tokenizing the default job's messages
#            at 100,000 and 300,000 rows by 1, 4, 8 and 16 processes and by data.tokenize_processes: auto
#            (python -m bench.tokenizing): whether auto's rows per process and fewest processes hold there
#
# OUT_DIR receives twenty-five flat files: parts.log (each part: passed, failed, timed out or skipped, and its
# seconds), tests.log, speed.md and speed.json (the tables, and every run with its seconds per update),
# host.md, graphs.md, update.md, products.md, products.json, products-no-lt.md,
# products-no-lt.json, attention.md, attention.json, casts.md, predict.md, engines.log, engines.md, engines.json, compile.md,
# compile.json, apart.md, apart.json, autotune.md, autotune.json and tokenizing.md; the working files (the model, every run) go to GPU_WORK (default
# OUT_DIR/work). A failing part does not stop the next; the exit status names the parts that failed.
#
# Settings: GPU_BUDGET_S=<seconds> fits the check into a time limit: each part runs under what is left, less
# GPU_RESERVE_S (default 60) for each part after it, and a part left less than that is skipped (a cut speed
# part keeps the rounds it finished, or in a single round the arms). GPU_BATCHING=b,k (default 64,4), GPU_STEPS (updates per speed run,
# default 40), GPU_REPEATS (default 2), GPU_ARMS (bench/run.py --only; `all` for every arm),
# GPU_ENGINE_REPEATS (the engine rows' repeats, default 1; 0 runs its tests alone), GPU_TEST_WORKERS (the tests
# part's pytest-xdist workers where it is installed, default 4), GPU_TESTS_K (a pytest -k expression that
# narrows the tests part), GPU_COMPILE_STEPS (updates
# per compile run, default 120), PYTHON (default python3). GPU_KIT=<folder> (default .gpu): what
# bench/gpu_kit.sh made for a machine without network; its wheels are installed under GPU_WORK and its
# tokenizer used unless FINETUNE_TOKENIZER names one.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."
all="tests speed host graphs update products casts predict engines compile apart autotune tokenizing"
out=${1:-bench/results/gpu}
[ $# -gt 0 ] && shift
parts=${*:-$all}
for part in $parts; do
    [[ " $all " == *" $part "* ]] || { echo "bench/gpu.sh: no part '$part' ($all)" >&2; exit 2; }
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=${GPU_WORK:-$out/work}
mkdir -p "$work"
work=$(cd "$work" && pwd)
py=${PYTHON:-python3}
budget=${GPU_BUDGET_S:-0}
reserve=${GPU_RESERVE_S:-60}
if [ -z "${GPU_ONE_PART:-}" ]; then  # the part runs below inherit this set-up
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    kit=${GPU_KIT:-.gpu}
    if compgen -G "$kit/wheels/*.whl" >/dev/null; then
        here=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        if [ -f "$kit/python-version" ] && [ "$(cat "$kit/python-version")" != "$here" ]; then
            echo "bench/gpu.sh: $kit holds wheels for Python $(cat "$kit/python-version"), this is $here:" \
                 "bench/gpu_kit.sh $kit $here" >&2
            exit 2
        fi
        [ -d "$work/site" ] || "$py" -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" "$kit"/wheels/*.whl
        export PYTHONPATH="$PYTHONPATH:$work/site"
    fi
    if [ -d "$kit/tokenizer" ] && [ -z "${FINETUNE_TOKENIZER:-}" ]; then
        FINETUNE_TOKENIZER=$(cd "$kit/tokenizer" && pwd)
        export FINETUNE_TOKENIZER
    fi
    "$py" -c "import torch; assert torch.cuda.is_available(), 'bench/gpu.sh: no CUDA GPU here'; print('gpu:', torch.cuda.get_device_name(), torch.__version__)"
fi

b_k=${GPU_BATCHING:-64,4}
b=${b_k%,*}
k=${b_k#*,}
model="$work/bert-base"
job=(model.name_or_path="$model" data.max_length=128 training.mixed_precision=bf16 training.per_device_train_batch_size="$b")
speed=(bench/run.py --datasets bbc --accuracy-seeds 0 --skip-grad-check --precision bf16 --batching "$b_k"
       --bbc-steps "${GPU_STEPS:-40}" --repeats "${GPU_REPEATS:-2}" --override model.name_or_path="$model"
       --override data.max_length=128)
arms=${GPU_ARMS:-=bbc/ours,=bbc/trainer,bbc/ours bk1,bbc/ours eager}
[ "$arms" = all ] && arms=""

bert_base() { [ -f "$model/config.json" ] || "$py" -m bench.bert_base "$model" ${FINETUNE_TOKENIZER:+--tokenizer "$FINETUNE_TOKENIZER"}; }
# the tests marked gpu that -k selects; -s: a failed launch prints its stderr at once, which a time limit keeps
gpu_tests() { "$py" -m pytest -m gpu -v -s -rs -p no:cacheprovider -k "$@"; }
# a comparison's report into OUT as NAME.md and NAME.json: the rounds that finished, also after a stop, and the
# raw runs the tables summarize (each update's seconds)
bring_back() {
    cp "$work/$1/bench.md" "$out/$1.md" 2>/dev/null || true
    cp "$work/$1/bench.json" "$out/$1.json" 2>/dev/null || true
}
part_tests() {
    # side by side where pytest takes pytest-xdist's workers (bench/gpu_kit.sh brings it; a collection asks,
    # since an xdist that imports may still not load into the machine's pytest): the tests' compiles and the CLI
    # runs they start keep the machine's CPUs busy, and the GPU has room for several tiny models at once
    local workers=() select="not fsdp and not deepspeed"
    "$py" -m pytest -p no:cacheprovider -n 0 -q --co -m gpu tests/test_gpu.py >/dev/null 2>&1 \
        && workers=(-n "${GPU_TEST_WORKERS:-4}" --dist load)
    # GPU_TESTS_K narrows them, as pytest's -k does (the tests of what changed, on a short lease)
    [ -n "${GPU_TESTS_K:-}" ] && select="($GPU_TESTS_K) and $select"
    gpu_tests "$select" ${workers[@]+"${workers[@]}"} tests/test_gpu.py tests/test_cuda_graphs.py \
        tests/test_gpu_engines.py tests/test_attention_kernel.py 2>&1 | tee "$out/tests.log"
}
part_speed() {
    local status=0
    bert_base && "$py" "${speed[@]}" --graphs --only "$arms" --out "$work/speed" || status=$?
    bring_back speed
    return $status
}
part_host() {
    bert_base && "$py" -m bench.probe device "${job[@]}" training.effective_batch_size=$((b * k)) 2>&1 | tee "$out/host.md"
}
part_graphs() { bert_base && "$py" -m bench.cuda_graphs --compiled --bias-apart "${job[@]}" 2>&1 | tee "$out/graphs.md"; }
part_update() {
    bert_base && "$py" -m bench.captured_update "${job[@]}" training.effective_batch_size=$((b * k)) 2>&1 \
        | tee "$out/update.md"
}
part_products() {
    local products=(-m bench.products --model "$model" --batch "$b" --length 128 --micro-batches "$k")
    bert_base && "$py" "${products[@]}" --json "$out/products.json" 2>&1 | tee "$out/products.md" || return
    # again with ATen's addmm kept off cuBLASLt (the bias added by a product that starts from it instead of in
    # cuBLASLt's epilogue): whether the environment alone gives the bias's product the plain product's speed
    DISABLE_ADDMM_CUDA_LT=1 "$py" "${products[@]}" --json "$out/products-no-lt.json" 2>&1 \
        | tee "$out/products-no-lt.md" || return
    "$py" -m bench.attention --model "$model" --batch "$b" --length 128 --micro-batches "$k" \
        --json "$out/attention.json" 2>&1 | tee "$out/attention.md"
}
part_casts() {
    bert_base && "$py" -m bench.probe casts "${job[@]}" training.effective_batch_size=$((b * k)) 2>&1 | tee "$out/casts.md"
}
part_predict() {
    bert_base && "$py" -m bench.predict "$model" --config configs/bbc_news.yaml --texts 2000 --batch-size 128 \
        --rounds 3 2>&1 | tee "$out/predict.md" || return
    # the default job's short texts, where padding a batch in Python weighs most beside its forward pass
    "$py" -m bench.predict "$model" --texts 20000 --batch-size 64 --rounds 3 --workers 4 --precision bf16 2>&1 \
        | tee -a "$out/predict.md"
}
part_engines() {
    local status=0 engines=fsdp
    "$py" -c "import deepspeed" 2>/dev/null && engines=fsdp,deepspeed_zero2
    gpu_tests "fsdp or deepspeed" tests/test_gpu_engines.py 2>&1 | tee "$out/engines.log" || status=$?
    # no repeats: the tests alone, which can share the GPU with the tests part (timings could not)
    [ "${GPU_ENGINE_REPEATS:-1}" = 0 ] && return $status
    # one repeat by default: the rows are for the engines' cost against the Trainer, which the speed part pins down
    bert_base && "$py" "${speed[@]}" --repeats "${GPU_ENGINE_REPEATS:-1}" --engines "$engines" \
        --only "=bbc/trainer,bbc/ours fsdp,bbc/ours deepspeed" \
        --out "$work/engines" || status=$?
    bring_back engines
    return $status
}
# a comparison of compiled arms over GPU_COMPILE_STEPS updates, one repeat, into OUT as NAME.md and NAME.json
compiled_runs() {
    local status=0
    bert_base && "$py" "${speed[@]}" --bbc-steps "${GPU_COMPILE_STEPS:-120}" --repeats 1 --graphs --only "$2" \
        --out "$work/$1" || status=$?
    bring_back "$1"
    return $status
}
part_compile() {
    compiled_runs compile "=bbc/trainer,=bbc/ours,=bbc/ours compiled graphs,=bbc/ours compiled blocks graphs"
}
part_apart() {
    # in bench/run.py's order: the two arms without a lever, each lever on compiled blocks, then on the graphed
    # default, then ATen's switch (no Trainer: MFU is the question here, and the speed part has its ratio)
    local ours="=bbc/ours compiled blocks graphs" arms="=bbc/ours,=bbc/ours compiled blocks graphs" lever
    for lever in "all levers" "cudnn attention" "fusion" "bias apart fusion" "bias apart" "addmm without cublaslt"; do
        arms+=",$ours $lever,=bbc/ours $lever"
    done
    compiled_runs apart "$arms"
}
part_autotune() {
    compiled_runs autotune "=bbc/trainer,=bbc/ours compiled blocks graphs,=bbc/ours compiled blocks autotuned graphs"
}
part_tokenizing() {
    "$py" -m bench.tokenizing --rows 100000,300000 --processes 1,4,8,16 --rounds 1 \
        ${FINETUNE_TOKENIZER:+--tokenizer "$FINETUNE_TOKENIZER"} 2>&1 | tee "$out/tokenizing.md"
}

# One part, run by the loop below as a child of this script (what `timeout` can signal as a whole)
if [ -n "${GPU_ONE_PART:-}" ]; then
    set -o pipefail
    "part_$GPU_ONE_PART"
    exit
fi

# Each part's seconds and outcome go to parts.log as they happen: a check cut short says how far it got.
started=$SECONDS
failed=""
set -- $parts
: > "$out/parts.log"
while [ $# -gt 0 ]; do
    part=$1; shift
    limit=()
    if [ "$budget" -gt 0 ]; then
        left=$(( budget - (SECONDS - started) - reserve * $# ))
        if [ "$left" -lt "$reserve" ]; then
            echo "$part: skipped, ${left}s of GPU_BUDGET_S=$budget left for it" | tee -a "$out/parts.log"
            continue
        fi
        limit=(timeout --signal=INT --kill-after=20 "$left")
        echo "== $part (at most ${left}s)"
    else
        echo "== $part"
    fi
    t0=$SECONDS
    status=0
    GPU_ONE_PART=$part GPU_WORK=$work "${limit[@]}" bash "$self" "$out" || status=$?
    case $status in
        0) outcome=passed ;;
        124|137) outcome="timed out"; failed="$failed $part" ;;
        *) outcome="failed ($status)"; failed="$failed $part" ;;
    esac
    echo "$part: $outcome in $((SECONDS - t0))s" | tee -a "$out/parts.log"
done
[ -z "$failed" ] || { echo "bench/gpu.sh: failed:$failed (see $out/parts.log)" >&2; exit 1; }
