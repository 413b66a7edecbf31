# Edgefleet's everyday commands. `make test` is the one CI runs.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: test lint crds controlplane

## Build (or reuse) the local control plane, then run every test.
test: controlplane
	$(CARGO) test --workspace --locked --no-fail-fast

## Formatting and clippy, warnings as errors.
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## Regenerate deploy/crds/ from the Rust types.
crds:
	$(CARGO) run -q -p edgefleet-cloud -- crds > deploy/crds/edgefleet.yaml

## The kube-apiserver + etcd binary the tests run (cached after the first build).
controlplane:
	@bash tests/controlplane/build.sh >/dev/null
