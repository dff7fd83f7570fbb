# One image for every node of a ddiloco swarm; each container is configured by a mounted TOML file
# (docker-compose.yml mounts deploy/<service>.toml at /etc/ddiloco/node.toml). See docs/swarm.md.
#
#   docker build -t ddiloco:local .
#   docker run --rm ddiloco:local node --help     # the entrypoint runs `ddiloco ARGS`
#
# PyTorch comes first, from its own index, so that layer survives code changes. The default is the CPU
# build (a small image). For a CUDA host pick a CUDA wheel index, e.g.
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t ddiloco:cuda .
# and give the containers the GPU (compose: deploy.resources.reservations.devices); the learner uses
# CUDA when torch sees it. hivemind ships its p2pd daemon in an x86_64 wheel only: build for linux/amd64.
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"

# The package itself (pyproject.toml: protocol*, dht*, node*; README.md is its readme), not editable.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY dht ./dht
COPY node ./node
COPY sim ./sim
RUN pip install . && rm -rf /src

COPY deploy/entrypoint.sh /usr/local/bin/ddiloco-entrypoint
COPY deploy/peer_id.py /usr/local/lib/ddiloco/peer_id.py

# An unprivileged user; /state (node state) and /peer (the bootstrap's published peer id) are volume mount
# points owned by it, so fresh named volumes start out writable for the node.
RUN useradd --create-home --uid 1000 ddiloco \
    && mkdir -p /state /peer /etc/ddiloco \
    && chown ddiloco:ddiloco /state /peer \
    && chmod 0755 /usr/local/bin/ddiloco-entrypoint
USER ddiloco
WORKDIR /state

# 31337: p2p (TCP); 8470: HTTP status endpoint (GET /status).
EXPOSE 31337 8470
ENTRYPOINT ["ddiloco-entrypoint"]
CMD ["node", "--config", "/etc/ddiloco/node.toml"]
