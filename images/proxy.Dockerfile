# meshlet-proxy and meshlet-init: the sidecar and its iptables init container.
# Build from the repository root: make images
FROM python:3.11-slim AS build
# python-iptables (a base dependency) has no wheels: its C extension is built here.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
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
# meshlet-init applies its plan through python-iptables (legacy tables: iptables brings the
# libxtables12 and libip4tc2 it loads, kmod the modprobe it runs on import) or with
# iptables-nft-restore (--mode nft); it runs as root with NET_ADMIN and NET_RAW only, the proxy
# as 2102.
RUN apt-get update \
    && apt-get install -y --no-install-recommends iptables kmod \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 2102:2102
ENTRYPOINT ["meshlet-proxy"]
