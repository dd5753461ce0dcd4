# speclab: the two commands of the README, plus helpers. Every target sets up .venv first.
PY := .venv/bin/python
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-unit lint bench gpu-report ui docs clean

# .venv/interop: the runtimes' own reading code the interop tests run (speculators' config
# and model classes), pinned, without their declared dependencies (torchaudio / torchvision
# are never imported there) and outside .venv's site-packages (the tests put it on
# PYTHONPATH of a subprocess; speclab's optional `datasets` paths never see it)
.venv/.installed: pyproject.toml constraints.txt tests/interop/requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps --upgrade --target .venv/interop -r tests/interop/requirements.txt
	touch $@

setup: .venv/.installed

demo: setup ## main job: reference pair + every engine method on local Ray, logged to MLflow
	$(PY) -m jobs.evaluate --config experiments/engine_methods.yaml

lint: setup
	.venv/bin/ruff check platform jobs serve_apps tests

# the tests run torch on one thread: their models are tiny (a second thread costs more
# than it gives), and every process of a test (job driver, Ray workers, servers) shares
# the machine's cores, where two spinning threads per process slow each other 10x or more
TEST_ENV := OMP_NUM_THREADS=1

# two test processes (pytest-xdist, one test file at a time in each). Measured on the
# same slow 2-core VM: the whole suite on two workers 69 min of tests; the Ray-free tests
# on two workers (6 min) then the integration tests one at a time (77 min) took 87 min in
# all, 3 under CI's 90. Every test takes free ports, its own SPECLAB_HOME, MLflow store and
# Ray session, so two run side by side. --durations: the 25 slowest tests close every
# full run (where CI time goes)
XDIST := -n 2 --dist loadfile
PYTEST := $(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider
test: setup lint ## ruff + the whole test suite
	$(PYTEST) $(XDIST) --durations=25 tests; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-unit: setup lint ## ruff + the unit tests only (no Ray started, a few minutes)
	$(PYTEST) $(XDIST) tests/unit; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

bench: setup
	.venv/bin/speclab bench

gpu-report: setup ## CUDA tests + benchmark on a GPU -> gpu_report/gpu_report.md (exit 0 without one)
	$(PY) -m speclab.gpu_report --out gpu_report

ui: setup
	.venv/bin/speclab ui

docs: setup ## the generated pages (configuration, home), then the site into site/
	$(PY) -m speclab.docs_pages
	$(PY) -m mkdocs build --strict

clean:
	rm -rf .venv bench_out site
