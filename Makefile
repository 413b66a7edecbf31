# Edgefleet's everyday commands. `make test` is the one CI runs.
SHELL := /bin/bash
CARGO ?= cargo

CERTS_DIR ?= .certs
# Where cargo puts what it builds ($CARGO_TARGET_DIR when set, as .ci/run
# sets it to a cache outside the clone).
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),target)

.PHONY: test lint fuzz crds certs controlplane image up bench bench-resync bench-ingest bench-rollout bench-rules bench-auth bench-scale

## Build (or reuse) the local control plane, then run every test.
test: controlplane
	$(CARGO) test --workspace --locked --no-fail-fast

## Formatting and clippy, warnings as errors.
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## Fuzz every decoder the agent exposes to a site's network (CoAP datagrams,
## device CBOR, MQTT packets and topics) for FUZZ_SECONDS each, from the
## seeds in tests/fuzz/seeds (libFuzzer through cargo-fuzz; nightly).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := coap_request device_cbor mqtt_packets dtls_datagrams
# Kept between runs on this machine: the nightly build of the agent's crates.
FUZZ_TARGET_DIR ?= $(HOME)/.cache/edgefleet/fuzz-target
fuzz:
	command -v cargo-fuzz >/dev/null || $(CARGO) install --locked cargo-fuzz
	for t in $(FUZZ_TARGETS); do \
		mkdir -p target/fuzz-corpus/$$t && \
		cargo +nightly fuzz run --fuzz-dir tests/fuzz --target-dir $(FUZZ_TARGET_DIR) $$t target/fuzz-corpus/$$t tests/fuzz/seeds/$$t \
			-- -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 || exit 1; \
	done

## Regenerate deploy/crds/ from the Rust types.
crds:
	$(CARGO) run -q -p edgefleet-cloud -- crds > deploy/crds/edgefleet.yaml

## A lab CA and the controller's sync certificate in $(CERTS_DIR), with the
## kubectl commands that load them (production: cert-manager, deploy/README.md).
certs:
	$(CARGO) run -q --locked -p edgefleet-cloud -- lab-certs --dir $(CERTS_DIR)

## The kube-apiserver + etcd binary the tests run (cached after the first build).
controlplane:
	@bash tests/controlplane/build.sh >/dev/null

## The agent's container image from the release binary, as an OCI archive
## to load on nodes without a registry (deploy/README.md). Needs umoci.
AGENT_IMAGE ?= ghcr.io/edgefleet/edgefleet-agent
AGENT_TAG ?= 0.1.0
IMAGE_OUT ?= target/images/edgefleet-agent-$(AGENT_TAG).oci.tar
image:
	$(CARGO) build --locked --release -p edgefleet-agent --bin edgefleet-agent
	bash deploy/image/build.sh $(IMAGE_OUT) $(AGENT_IMAGE) $(AGENT_TAG) 65532:65532 \
		/usr/local/bin/edgefleet-agent $(TARGET_DIR)/release/edgefleet-agent=/usr/local/bin/edgefleet-agent

## The whole system on this machine with ~300 simulated devices and a live
## fleet view, until Ctrl-C (uses $KUBECONFIG's cluster when set).
up: controlplane
	$(CARGO) build --locked --bins
	$(TARGET_DIR)/debug/edgefleet-up

## Measure propagation, report->status latency and the status write budget
## (1,000 devices on 3 agents, release build). Figures: docs/benchmarks.md.
bench: controlplane
	$(CARGO) build --locked --release --bins
	$(TARGET_DIR)/release/edgefleet-bench $(BENCH_ARGS)

## Measure an edge site's resync after an outage: 1,000 devices on one agent
## cut off for 30 minutes of traffic (compressed), then reconnected.
## Figures: docs/benchmarks.md.
bench-resync: controlplane
	$(CARGO) build --locked --release --bins
	$(TARGET_DIR)/release/edgefleet-resync-bench $(BENCH_ARGS)

## Measure a firmware rollout: 1,000 devices over 10 sites, 10% per site at
## once, installs of 5-20 s (release build). Figures: docs/benchmarks.md.
bench-rollout: controlplane
	$(CARGO) build --locked --release --bins
	$(TARGET_DIR)/release/edgefleet-rollout-bench $(BENCH_ARGS)

## Measure the agent's durable ingest: CoAP reports and MQTT events per
## second and their acknowledgement latency, with and without group commit
## and the power-cut syncs (release build). Figures: docs/benchmarks.md.
bench-ingest:
	$(CARGO) build --locked --release --bin edgefleet-ingest-bench
	$(TARGET_DIR)/release/edgefleet-ingest-bench $(BENCH_ARGS)

## Measure EdgeRules: evaluations per CPU-second with 100 rules over 1,000
## devices and the memory they take, and report -> action at the device
## against the cloud round trip (release build). Figures: docs/benchmarks.md.
bench-rules: controlplane
	$(CARGO) build --locked --release --bins
	$(TARGET_DIR)/release/edgefleet-rules-bench $(BENCH_ARGS)

## Measure what TLS and node identity cost on the sync link: handshakes,
## a 1,000-agent reconnect storm, bulk delivery, each against plaintext in
## the same run (release build). Figures: docs/benchmarks.md.
bench-auth: controlplane
	$(CARGO) build --locked --release --bins
	$(TARGET_DIR)/release/edgefleet-auth-bench $(BENCH_ARGS)

## Measure the controller as the fleet grows: RSS per Device and per
## connected agent, a fleet-wide change's delivery, a restart's resync, at
## 1k/10k/100k Devices on 10/100/1,000 hollow agents (release build).
## Figures: docs/benchmarks.md.
bench-scale: controlplane
	$(CARGO) build --locked --release --bins
	$(TARGET_DIR)/release/edgefleet-scale-bench $(BENCH_ARGS)
