# Two commands for a new user: `make train` and `make test`. Both set themselves up.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
NPROC   ?= $(shell $(PY) -c "import shutil,subprocess;print(subprocess.run(['nvidia-smi','-L'],capture_output=True,text=True).stdout.count('GPU ') if shutil.which('nvidia-smi') else 0)" 2>/dev/null)

.PHONY: setup train test test-all lint format bench clean

setup: $(STAMP)

# What `make train` needs: torch and the launcher's packages.
$(RUN_STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	@# torch first and pinned: the local CPU wheel where one lies on disk, the CUDA build from PyPI on a GPU machine.
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[launch]"
	touch $(RUN_STAMP)

# Everything: tests, lint, benchmarks.
$(STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,launch,bench,hf,lightning,accelerate,trl,deepspeed]"
	touch $(STAMP)

# The default job (or ARGS="strategy=fsdp2 trainer.max_steps=50 ..."); overrides are checked before torchrun
# starts, so a bad one prints one line and exits 2. Outputs: outputs/<model>-<strategy>/<run id>/.
# launch/torchrun.py is torchrun exiting with the workers' code (2: config/resume error, 3: non-finite stop).
train: $(RUN_STAMP)
	@if [ "$(NPROC)" -gt 0 ] 2>/dev/null; then n=$(NPROC); else n=2; fi; \
	DISTCKPT_NPROC=$$n $(BIN)/python launch/train.py --check $(ARGS) || exit $$?; \
	echo "torchrun --standalone --nproc_per_node=$$n launch/train.py $(ARGS)"; \
	OMP_NUM_THREADS=1 $(BIN)/python -m launch.torchrun --standalone --nproc_per_node=$$n launch/train.py $(ARGS)

# Lint and formatting: `make format` fixes what both report.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest-xdist workers: the tests run one-threaded (as torchrun's workers do), so one core would idle.
# --dist loadgroup: the tests that share a module fixture stay on one worker, the heaviest first (tests/conftest.py).
PYTEST_ARGS ?= -n 2 --dist loadgroup
# The default tier: lint, then every test but the slow ones (and the cuda ones without a GPU).
test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything, as CI runs it (.ci/run): `make test`, then the slow tier (-m slow: every test the default run
# skips, sweeps beyond a core set and cases whose path a default test takes; the cuda ones still need a GPU).
test-all: test
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_ARGS) -m slow

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.memory

clean:
	rm -rf $(VENV) outputs runs .pytest_cache .ruff_cache
