# make venv   - .venv with the pinned requirements and this package (editable), via uv
# make demo   - the CPU demo: 4 ranks, PP 2 x DP 2, DiLoCoX with 2 replicas (ARGS=... to add flags)
# make test   - the test suite
# make bench-wan - throughput over an emulated slow network (root; ARGS=... to add flags)
# make bench-venv - .venv plus the benchmarks' pinned plotting extra (requirements-bench.txt)
# make docs   - regenerate docs/flags.md from the --diloco-x* argparse group
# make plots  - regenerate every plot of benchmarks/plots/ from benchmarks/results/*.json

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
NPROC ?= 4
ARGS ?=
TEST_TIMEOUT ?= 1800

# Python 3.12: first on PATH, else a pyenv install; checked by running it (pyenv shims exist even
# when the version they point to is not selected).
PYTHON312 ?= $(shell for p in python3.12 /root/.pyenv/versions/3.12.*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 \
	&& { command -v $$p; break; }; done)

.PHONY: venv bench-venv demo test bench-wan docs plots clean-venv

venv: $(STAMP)

$(STAMP): requirements.txt setup.py
	@if [ -z "$(PYTHON312)" ]; then \
		echo "error: Python 3.12 not found (looked for python3.12 on PATH and" \
		     "/root/.pyenv/versions/3.12.*/bin/python3.12); set PYTHON312=/path/to/python3.12" >&2; \
		exit 1; fi
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q uv
	# --compile-bytecode: torch + megatron import ~2x faster (PYTHONDONTWRITEBYTECODE may be set).
	$(VENV)/bin/uv pip install --python $(PY) --compile-bytecode -r requirements.txt -e .
	touch $@

bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(VENV)/bin/uv pip install --python $(PY) --compile-bytecode -r requirements.txt -r requirements-bench.txt
	touch $@

demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
		examples/pretrain_gpt_diloco.py $(ARGS)

test: venv
	timeout $(TEST_TIMEOUT) $(PY) -m pytest -q tests

# Needs root (network namespaces, tc); about 10 minutes on 2 CPU cores. Writes
# benchmarks/results/wan.json and benchmarks/plots/wan.png.
bench-wan: bench-venv
	$(PY) benchmarks/throughput/wan_bench.py $(ARGS)

docs: venv
	$(PY) docs/gen_flags.py > docs/flags.md.tmp && mv docs/flags.md.tmp docs/flags.md

# Reads benchmarks/results/*.json only (no GPU, no run); stamps each plot with the commit.
plots: bench-venv
	$(PY) benchmarks/plots.py

clean-venv:
	rm -rf $(VENV)
