# kv-indexer container image: build with cargo, run from a slim non-root base.
# Build: docker build -t kv-indexer .
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
# protoc comes from the protoc-bin-vendored crate and TLS from rustls: no system packages.
RUN cargo build --release --locked --bin kv-indexer

# distroless/cc: glibc and libgcc only; no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kv-indexer /usr/local/bin/kv-indexer
COPY --from=build /src/config/kv-indexer.yaml /etc/kv-indexer/kv-indexer.yaml
USER 65532:65532
# gRPC, metrics/probes, ZMQ (bind mode)
EXPOSE 50051 9090 5557
ENTRYPOINT ["/usr/local/bin/kv-indexer"]
# The shipped config keeps the ZMQ intake on loopback; open it on purpose, e.g.
#   docker run ... serve --config /etc/kv-indexer/kv-indexer.yaml --zmq-endpoint 'tcp://*:5557'
# (the Helm chart mounts its own config, which does, with a NetworkPolicy).
CMD ["serve", "--config", "/etc/kv-indexer/kv-indexer.yaml", "--log-format", "json"]
