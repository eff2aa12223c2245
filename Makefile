# `make demo` and `make test` work on a fresh machine: they create .venv and install what is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# DeepSpeed JIT-builds its CPU ops against this venv's torch headers: keep the builds with the venv, so
# two checkouts on one machine do not rebuild over each other's cache.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: install test demo clean gpu-check

# bitsandbytes (the QLoRA tests) goes in a folder of its own: PEFT imports it in every process where it is installed
# (~1.3 s of CPU each, in every launched rank); the tests put it on the path of the runs that quantise
# (tests/launch.py QLORA_SITE). Users install it with shardscope[qlora].
$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[deepspeed,peft,recipes,test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(VENV)/qlora bitsandbytes==0.50.2
	$(PY) scripts/build_deepspeed_ops.py
	touch $(STAMP)

install: $(STAMP)

# Two pytest-xdist workers: a 2-rank launch leaves a core idle about a third of its time. Tests that share a
# launched run stay on one worker (tests/conftest.py, pytest_xdist_make_scheduler).
test: install
	$(PY) -m pytest -n 2 tests

demo: install
	bash scripts/demo.sh

# On a machine with one CUDA GPU (the venv's torch a CUDA build): benchmarks/results/gpu_check.md in ~4 min.
gpu-check: install
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) demo_out
