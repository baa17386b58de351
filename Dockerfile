# syntax=docker/dockerfile:1
# Two images from one file, each with only what it runs, as a non-root user on a
# read-only root filesystem (writes go only to /run/lease, the shared emptyDir, and /tmp):
#
#   docker build --target sidecar -t lease-sidecar .            # the default target
#   docker build --target operator -t lease-sidecar-operator .
#
# - sidecar: `lease-sidecar run` (every backend; no kopf). Injected into every replica,
#   so it carries no admission or operator code.
# - operator: `lease-sidecar operator` (the admission webhook and the lease-role label
#   reconciler; kopf, the kubernetes client, cryptography), no database drivers.
#
# SQL Server's ODBC driver is FreeTDS from Debian by default. For Microsoft's
# ODBC Driver 18 (by building it you accept Microsoft's licence terms), name Microsoft's
# Debian 12 package repository and signing key, as given in Microsoft's install guide:
#
#   docker build --build-arg ODBC_DRIVER=msodbcsql18 \
#     --build-arg MSODBC_APT_REPO=<repository URL> \
#     --build-arg MSODBC_KEY_URL=<signing key URL> -t lease-sidecar:msodbc .
#
# Needs BuildKit (the default builder): it builds only the ODBC stage that is selected.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG ODBC_DRIVER=freetds

# ---- build: the sidecar's virtualenv, with every backend the Helm chart can use
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/lease-sidecar
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
# Extras: postgres (postgres, postgres-row), sqlserver (pyodbc), kubernetes (the backend;
# the lease-role label and Events need nothing extra). pip byte-compiles what it
# installs, so nothing needs writing at run time.
RUN /opt/lease-sidecar/bin/pip install ".[postgres,sqlserver,kubernetes]"

# ---- build-operator: the operator's virtualenv (kopf, kubernetes client, cryptography)
FROM ${PYTHON_IMAGE} AS build-operator
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/lease-sidecar
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN /opt/lease-sidecar/bin/pip install ".[injector]"

# ---- operator: lease-sidecar operator (no ODBC, no database driver)
FROM ${PYTHON_IMAGE} AS operator
ENV PATH=/opt/lease-sidecar/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 lease \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin lease
COPY --from=build-operator /opt/lease-sidecar /opt/lease-sidecar
USER 10001:10001
EXPOSE 8443 8080
ENTRYPOINT ["lease-sidecar"]
CMD ["operator"]

# ---- runtime base: the ODBC driver manager pyodbc links against
FROM ${PYTHON_IMAGE} AS runtime-base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends unixodbc \
 && rm -rf /var/lib/apt/lists/*

# ---- ODBC driver, default: FreeTDS from Debian, registered as "FreeTDS"
FROM runtime-base AS odbc-freetds
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tdsodbc \
 && rm -rf /var/lib/apt/lists/* \
 && odbcinst -q -d -n FreeTDS

# ---- ODBC driver, optional: Microsoft's ODBC Driver 18 for SQL Server
FROM runtime-base AS odbc-msodbcsql18
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG MSODBC_APT_REPO=""
ARG MSODBC_KEY_URL=""
# hadolint ignore=DL3008
RUN if [ -z "$MSODBC_APT_REPO" ] || [ -z "$MSODBC_KEY_URL" ]; then \
      echo "ODBC_DRIVER=msodbcsql18 needs --build-arg MSODBC_APT_REPO and MSODBC_KEY_URL" >&2; \
      exit 1; \
    fi \
 && apt-get update \
 && apt-get install -y --no-install-recommends curl gnupg \
 && curl -fsSL "$MSODBC_KEY_URL" | gpg --dearmor -o /usr/share/keyrings/microsoft-prod.gpg \
 && echo "deb [signed-by=/usr/share/keyrings/microsoft-prod.gpg] $MSODBC_APT_REPO bookworm main" \
      > /etc/apt/sources.list.d/microsoft-prod.list \
 && apt-get update \
 && ACCEPT_EULA=Y apt-get install -y --no-install-recommends msodbcsql18 \
 && apt-get purge -y --auto-remove curl gnupg \
 && rm -rf /var/lib/apt/lists/* \
 && odbcinst -q -d -n "ODBC Driver 18 for SQL Server"
ENV LEASE_ODBC_DRIVER="ODBC Driver 18 for SQL Server"

# ---- sidecar: the default target, last (hadolint cannot see that odbc-* names a stage
# above, not an image)
# hadolint ignore=DL3006
FROM odbc-${ODBC_DRIVER} AS sidecar
ENV PATH=/opt/lease-sidecar/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# A fixed numeric uid/gid, so runAsNonRoot can verify it without /etc/passwd lookups.
RUN groupadd --system --gid 10001 lease \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin lease \
 && install -d -o 10001 -g 10001 -m 0755 /run/lease
COPY --from=build /opt/lease-sidecar /opt/lease-sidecar
USER 10001:10001
EXPOSE 8099
ENTRYPOINT ["lease-sidecar"]
CMD ["run"]
