# meshlet-proxy and meshlet-init: the sidecar and its iptables init container.
# Build from the repository root: make images
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto proto
COPY controlplane controlplane
COPY proxy proxy
COPY init init
COPY cli cli
COPY charts charts
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# meshlet-init applies its plan with iptables-restore (legacy or nft); it runs as root with
# NET_ADMIN and NET_RAW only, the proxy as 2102.
RUN apt-get update \
    && apt-get install -y --no-install-recommends iptables \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 2102:2102
ENTRYPOINT ["meshlet-proxy"]
