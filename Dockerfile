# kvroute's image: every command (`kvroute control-plane`, `router`, `agent`, ...) from one wheel.
# Multi-stage: the build stage makes a virtualenv; the final stage copies only that, runs as a non-root
# user and holds no compiler, pip cache or source tree. deploy/kubernetes/ runs it.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A C compiler for the prefix index's extension (kvroute/prefix_index/_native.c; the image has Python's
# headers). Only this stage has it; unpinned: the distribution's own gcc is what builds for its libc.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvroute
# Every folder the wheel packages (pyproject's package-dir), nothing else.
COPY pyproject.toml README.md ./
COPY kvroute ./kvroute
COPY control_plane ./control_plane
COPY data_plane ./data_plane
COPY worker_agent ./worker_agent
COPY tools ./tools
# Run after installing the epp extra (see below); not part of the wheel.
COPY scripts/restore_shadowed_protos.py ./scripts/
# The runtime dependencies and the `epp` extra (Envoy's protos: `kvroute epp`, the gateway component);
# no `tools` extra (the image runs the product, not the benches). xds-protos overwrites modules of
# opentelemetry-proto and googleapis-common-protos: the script reinstalls those two with pip
# (docs/epp.md), so it runs before pip is removed, and fails the build if one stays overwritten.
# Byte-compiled here: the containers' root filesystem is read-only, so a process could not cache it.
RUN /opt/kvroute/bin/pip install '.[epp]' \
    && /opt/kvroute/bin/python scripts/restore_shadowed_protos.py \
    && /opt/kvroute/bin/pip uninstall --yes pip setuptools wheel

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/kvroute /opt/kvroute
# A numeric user, so Kubernetes' runAsNonRoot can check it without a passwd entry.
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["kvroute"]
CMD ["--help"]
