# The README's two commands: `make demo` and `make test`. Each sets up everything it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned in the same pip command that installs it, so pip never picks a CUDA build.
TORCH ?= torch==2.13.0
BASE := $(VENV)/.base
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean

# what the demo needs: the core, the fs tier and torch (CPU build)
$(BASE): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" -e .
	touch $(BASE)

# what the tests need besides: S3 client and server, NIXL, the example tier, test tools
$(STAMP): $(BASE)
	$(BIN)/pip install -q "$(TORCH)" -e ".[obj,test,nixl]" -e ./examples/kvtiers-sqlite
	touch $(STAMP)

venv: $(STAMP)

demo: $(BASE)
	$(BIN)/kvtiers demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info */*.egg-info
