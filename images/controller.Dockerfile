# meshlet-controller (destination, identity, injector): the base dependencies only, no CLI extra.
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
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 2103:2103
ENTRYPOINT ["meshlet-controller"]
