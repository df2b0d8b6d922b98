# The README's two commands: `make demo` and `make test` (the quick tier); `make test-all` is the full matrix
# that CI runs. Each builds .venv first if needed. The tiers are set in tests/conftest.py (FULL_ONLY).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megatron_md-installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-e2e test-slow test-reshard test-multirank test-profile coverage params gpu-smoke gpu-bench bench bench-counts readme records clean-runs

setup: $(STAMP)

$(STAMP): pyproject.toml tools/setup_venv.sh
	VENV=$(VENV) bash tools/setup_venv.sh
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megatron-md demo

# Into the environment of PYTHON (an NGC container's, say), keeping its torch and Transformer Engine
# (docs/install.md, path b; no .venv). The wheel, with the recipes and the corpus, into dist/ (built by
# .venv's Python if there is one, else PYTHON's; it must be 3.12 or newer).
.PHONY: install-env wheel
PYTHON ?= python3
install-env:
	$(PYTHON) -m pip install --no-build-isolation ".[gpu]"

wheel:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip wheel --no-deps -w dist . && rm -rf build

# Quick tier: every cheap test and one case of each expensive family (docs/tests.md).
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not full" $(PYTEST_ARGS)

# Full matrix: what CI runs.
test-all: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The full matrix with every megatron-md command through the real CLI and torchrun, none in the pooled worlds
# (tests/harness/pool.py): the suite as it ran before them, about an hour on 2 cores.
test-e2e: $(STAMP)
	$(PY) -m pytest -m "not slow" --launch=cli $(PYTEST_ARGS)

# make test-all with every test's time (--durations=0) and every command counted, recorded as
# benchmarks/results/test_profile_after.json (tools/test_profile.py; `make readme` renders docs/tests.md's table).
PROFILE := runs/test-profile
test-profile: $(STAMP)
	rm -rf $(PROFILE) && mkdir -p $(PROFILE)
	$(PY) -m pytest --collect-only -q -m "not slow" > $(PROFILE)/ids.txt
	$(PY) -m pytest --collect-only -q -m "not slow and not full" > $(PROFILE)/quick_ids.txt
	set -o pipefail; MDTEST_LAUNCH_LOG=$(CURDIR)/$(PROFILE)/launches.jsonl $(PY) -m pytest -m "not slow" --durations=0 \
		$(PYTEST_ARGS) | tee $(PROFILE)/pytest.log
	$(PY) tools/test_profile.py record $(PROFILE)/pytest.log --label after --ids $(PROFILE)/ids.txt \
		--quick-ids $(PROFILE)/quick_ids.txt --launches $(PROFILE)/launches.jsonl \
		-o benchmarks/results/test_profile_after.json

# Line coverage of megatron_md/ under the full matrix, in every process it starts (pyproject.toml's
# [tool.coverage.run]); fails when below the figure before the suite was made faster (tools/coverage_check.py).
coverage: $(STAMP)
	rm -rf runs/coverage && mkdir -p runs/coverage
	export COVERAGE_FILE=$(CURDIR)/runs/coverage/.coverage; \
	$(PY) -m coverage run -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	$(PY) -m coverage combine -q && $(PY) -m coverage json -q -o runs/coverage/coverage.json && \
	$(PY) -m coverage report --skip-covered > runs/coverage/report.txt; \
	$(PY) tools/coverage_check.py runs/coverage/coverage.json && exit $$rc

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-multirank: $(STAMP)
	$(PY) -m pytest -m multirank $(PYTEST_ARGS)

params: $(STAMP)
	$(VENV)/bin/megatron-md params

gpu-smoke: $(STAMP)
	bash tools/gpu_smoke.sh

# One GPU: throughput, MFU, optimizer-step time and profile, memory, save/resume, MoE, attention backends
# -> runs/gpu_bench/gpu_bench.json (PART=1 then PART=2 fit two 10-minute calls; benchmarks/README.md)
gpu-bench: $(STAMP)
	bash tools/gpu_bench.sh

bench: $(STAMP)
	$(PY) benchmarks/optimizer_step.py

# Ops and device->host syncs of one optimizer step per preset structure and optimizer (CPU, under a minute);
# then `make readme` puts benchmarks/results/step_counts_cpu.md's table into docs/performance.md.
bench-counts: $(STAMP)
	$(PY) benchmarks/step_counts.py

# Redraw the records' figures and rewrite the generated tables in README.md and docs/ (records/, benchmarks/results/).
readme: $(STAMP)
	$(PY) tools/plot_records.py $$(ls -d records/*-lr-transfer records/*-md-ablations records/*-manifold-geometry 2>/dev/null)
	$(PY) tools/render_readme_tables.py

# Rerun the CPU records into runs/records/ (hours on 2 cores; resumable; records/ is never touched).
records: $(STAMP)
	for r in records/*/reproduce.sh; do bash $$r || exit 1; done

clean-runs:
	@echo "runs/ holds your runs and checkpoints; remove it by hand if you mean it."

# The whole save/resume/reshard matrix of the distributed optimizer
# (tests/training/checkpoints/test_distributed_resume.py).
test-reshard: $(STAMP)
	$(PY) -m pytest -m "slow or not slow" tests/training/checkpoints/test_distributed_resume.py $(PYTEST_ARGS)
