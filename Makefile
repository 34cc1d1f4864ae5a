# vlmspec: `make serve` starts the service on the bundled model, `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch/torchvision are pinned to the wheels this project is developed and tested with
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP  := $(VENV)/.vlmspec-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: setup test test-all serve demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

# the default suite: maths on constructed tensors + tiny in-process HF models (no slow/gpu figures)
test: setup
	$(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# the OpenAI-compatible API on the bundled model (prints its URLs); `make demo` answers one prompt in the terminal
serve: setup
	$(VENV)/bin/vlmspec serve --host $(HOST) --port $(PORT)

DEMO_IMAGE  ?= assets/images/toyworld_scene.png
DEMO_PROMPT ?= Describe the picture.
demo: setup
	$(VENV)/bin/vlmspec generate --image $(DEMO_IMAGE) --prompt "$(DEMO_PROMPT)" --max-new-tokens 128

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
