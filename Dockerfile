# syntax=docker/dockerfile:1
# The mcp-run image: the gateway (`mcp-run`, the entrypoint) and the client (`run-remote`).
#
#   docker build -t mcp-run:dev .
#
# Builder: the official Rust image on Debian trixie (13), the same Debian release as the
# runtime image, so the binaries link against the glibc they will run with.
# Runtime: distroless cc (glibc, libgcc, CA certificates, nothing else: no shell, no package
# manager), running as the built-in non-root user 65532. The gateway reaches the API server
# with the service account's own CA, but the CA bundle is still needed by run-remote and the
# remote backend for https gateways, and it costs about 200 KiB.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-slim-trixie AS builder
WORKDIR /src
# The whole source tree (see .dockerignore): Cargo needs every target the manifest names,
# benches and tests included, even to build the binaries alone.
COPY . .
# The cache mounts keep the registry and the build directory between builds (BuildKit);
# the binaries are copied out of the cached target directory.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
    && mkdir -p /out \
    && cp target/release/mcp-run target/release/run-remote /out/

FROM gcr.io/distroless/cc-debian13:nonroot
LABEL org.opencontainers.image.title="mcp-run" \
      org.opencontainers.image.description="Kubernetes-native remote runner: one ephemeral pod per command, streamed over HTTP and MCP" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /out/mcp-run /out/run-remote /usr/local/bin/
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/mcp-run"]
CMD ["serve", "--listen", "0.0.0.0:8080"]
