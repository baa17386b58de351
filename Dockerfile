# syntax=docker/dockerfile:1
# Three images from one file, each with only what it runs, as a non-root user on a
# read-only root filesystem (writes go only to /run/lease, the shared emptyDir, and /tmp):
#
#   docker build --target sidecar -t lease-sidecar .            # the default target
#   docker build --target sidecar-sqlserver -t lease-sidecar-sqlserver .
#   docker build --target operator -t lease-sidecar-operator .
#
# - sidecar: `lease-sidecar run` on every backend but SQL Server (kubernetes, postgres,
#   postgres-row, sqlite). Injected into every replica, so it holds nothing else: the
#   virtualenv, its Python and the shared libraries they load, gathered by
#   scripts/image-rootfs.sh onto an empty root (no shell, no package manager).
# - sidecar-sqlserver: the same plus pyodbc, unixODBC and an ODBC driver; the Helm chart
#   picks it when lease.backend is sqlserver.
# - operator: `lease-sidecar operator` (the admission webhook and the lease-role label
#   reconciler; kopf, the kubernetes client, cryptography), no database drivers, gathered
#   onto an empty root the same way.
#
# SQL Server's ODBC driver is FreeTDS from Debian by default. For Microsoft's
# ODBC Driver 18 (by building it you accept Microsoft's licence terms), name Microsoft's
# Debian 12 package repository and signing key, as given in Microsoft's install guide:
#
#   docker build --target sidecar-sqlserver --build-arg ODBC_DRIVER=msodbcsql18 \
#     --build-arg MSODBC_APT_REPO=<repository URL> \
#     --build-arg MSODBC_KEY_URL=<signing key URL> -t lease-sidecar-sqlserver:msodbc .
#
# Needs BuildKit (the default builder): it builds only the stages the target needs.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG ODBC_DRIVER=freetds

# ---- build: the sidecar's virtualenv, with every backend but SQL Server
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/lease-sidecar
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
# Extras: postgres (postgres, postgres-row), kubernetes (the backend; the lease-role label
# and Events need nothing extra). pip byte-compiles what it installs, so nothing needs
# writing at run time.
RUN /opt/lease-sidecar/bin/pip install ".[postgres,kubernetes]"

# ---- build-sqlserver: the same virtualenv plus pyodbc
FROM build AS build-sqlserver
RUN /opt/lease-sidecar/bin/pip install ".[sqlserver]"

# ---- build-operator: the operator's virtualenv (kopf, kubernetes client, cryptography)
FROM ${PYTHON_IMAGE} AS build-operator
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/lease-sidecar
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN /opt/lease-sidecar/bin/pip install ".[injector]"

# ---- rootfs-operator: what the operator image holds, gathered like the sidecar's
FROM ${PYTHON_IMAGE} AS rootfs-operator
COPY --from=build-operator /opt/lease-sidecar /opt/lease-sidecar
COPY scripts/image-rootfs.sh /usr/local/bin/
RUN image-rootfs.sh /rootfs

# ---- operator: lease-sidecar operator (no ODBC, no database driver), on an empty root
# like the sidecar images (see runtime below)
FROM scratch AS operator
ENV PATH=/opt/lease-sidecar/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=rootfs-operator /rootfs /
COPY --from=rootfs-operator /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/
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

# ---- rootfs: what the sidecar image holds, gathered into /rootfs
FROM ${PYTHON_IMAGE} AS rootfs
COPY --from=build /opt/lease-sidecar /opt/lease-sidecar
COPY scripts/image-rootfs.sh /usr/local/bin/
RUN image-rootfs.sh /rootfs

# ---- rootfs-sqlserver: the same, with pyodbc and the ODBC driver manager and driver
# hadolint ignore=DL3006
FROM odbc-${ODBC_DRIVER} AS rootfs-sqlserver
COPY --from=build-sqlserver /opt/lease-sidecar /opt/lease-sidecar
COPY scripts/image-rootfs.sh /usr/local/bin/
RUN image-rootfs.sh /rootfs

# ---- runtime: how a sidecar image runs. Its files: a rootfs stage's /rootfs, which holds
# the user (a fixed numeric uid/gid, so runAsNonRoot can verify it without lookups) and
# /run/lease; and that stage's CA bundle, taken from its layers, not in a RUN (see
# image-rootfs.sh).
FROM scratch AS runtime
ENV PATH=/opt/lease-sidecar/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
EXPOSE 8099
ENTRYPOINT ["lease-sidecar"]
CMD ["run"]

# ---- sidecar-sqlserver: the sidecar for lease.backend=sqlserver
FROM runtime AS sidecar-sqlserver
COPY --from=rootfs-sqlserver /rootfs /
COPY --from=rootfs-sqlserver /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/

# ---- sidecar: the default target, last
FROM runtime AS sidecar
COPY --from=rootfs /rootfs /
COPY --from=rootfs /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/
