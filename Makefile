# Quickstart targets: `make train` (default config) and `make test` (the test suite).
# Both create .venv on first use. The venv sees the system's site-packages, so a GPU
# machine keeps the CUDA torch it already has; where no torch is installed, TORCH is
# installed first (a CPU build, unless TORCH names another).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
CONFIG ?= configs/default.yaml
BIN    := $(VENV)/bin

.PHONY: install train test floors bench gpu-check clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[test]"
	touch $@

install: $(BIN)/.installed

train: install
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(BIN)/accelerate launch -q --num_processes 1 --num_machines 1 \
		--mixed_precision no --dynamo_backend no finetune/train.py --config $(CONFIG) $(ARGS)

# one worker per core (pytest-xdist), each test file kept on one worker so that its module-scoped
# set-up runs once, the longest files handed out first (tests/conftest.py: xdist keeps that order)
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15 tests $(ARGS)

# every test on the oldest release of each dependency pyproject.toml allows (.ci/floors: uv, and torch's
# floor from PyPI, a CUDA build of about 3 GB); ARGS: pytest's arguments instead
floors: install
	$(BIN)/pip install -q uv
	PATH=$(BIN):$$PATH PYTHON=$(PYTHON) .ci/floors $(ARGS)

# the side-by-side comparison with transformers.Trainer (bench/README.md); ~25 min on 2 CPU cores
bench: install
	$(BIN)/python bench/run.py $(ARGS)

# on a CUDA machine: the tests marked gpu, the speed comparison on a bert-base-sized model, the probes, FSDP and
# DeepSpeed (bench/gpu.sh); ARGS="OUT_DIR PART ..." runs some of its parts (tests, speed, host, graphs, update, products, casts, predict, engines, compile, apart, autotune, tokenizing)
gpu-check: install
	PATH=$(BIN):$$PATH bench/gpu.sh $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
