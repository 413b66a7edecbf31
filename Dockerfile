# syntax=docker/dockerfile:1
#
# Edgefleet's images, one per binary, from one build:
#
#   docker build --target cloud -t ghcr.io/edgefleet/edgefleet-cloud:0.1.0 .
#   docker build --target agent -t ghcr.io/edgefleet/edgefleet-agent:0.1.0 .
#   docker build --target sim   -t ghcr.io/edgefleet/edgefleet-sim:0.1.0 .
#
# Without --target you get the last stage, the cloud controller. The runtime
# images are distroless (glibc, CA certificates, no shell) and run as the
# numeric user 65532 ("nonroot"), which the manifests in deploy/ expect.
# Needs BuildKit (the default builder of current Docker and of buildah/podman).

# The builder must use the same Debian release as the runtime image
# (bookworm = Debian 12), so the binaries find the glibc they were linked
# against. Rust 1.89 is the workspace's minimum.
ARG RUST_VERSION=1.95
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
COPY . .
# The cache mounts keep downloaded crates and compiled dependencies between
# builds; the binaries are copied out of the cached target directory in the
# same step, because cache mounts are not part of the image. The protobuf
# contract is compiled by protox (pure Rust): no protoc needed.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
 && mkdir -p /out/data \
 && cp target/release/edgefleet-cloud \
       target/release/edgefleet-agent \
       target/release/edgefleet-sim /out/

FROM ${RUNTIME_IMAGE} AS agent
COPY --from=builder /out/edgefleet-agent /usr/local/bin/edgefleet-agent
# The store's default place, owned by the agent's user, so a volume mounted
# there (docker run -v edgefleet:/var/lib/edgefleet) starts out writable.
COPY --from=builder --chown=65532:65532 /out/data /var/lib/edgefleet
USER 65532:65532
# CoAP, the embedded MQTT broker, /metrics and /healthz.
EXPOSE 5683/udp 1883/tcp 9464/tcp
ENTRYPOINT ["/usr/local/bin/edgefleet-agent"]

FROM ${RUNTIME_IMAGE} AS sim
COPY --from=builder /out/edgefleet-sim /usr/local/bin/edgefleet-sim
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/edgefleet-sim"]

FROM ${RUNTIME_IMAGE} AS cloud
COPY --from=builder /out/edgefleet-cloud /usr/local/bin/edgefleet-cloud
USER 65532:65532
# gRPC sync for agents; /metrics, /healthz, /readyz.
EXPOSE 7443/tcp 9090/tcp
ENTRYPOINT ["/usr/local/bin/edgefleet-cloud"]
CMD ["run"]
