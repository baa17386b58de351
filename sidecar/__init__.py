"""lease-sidecar: hold a distributed lease for this pod and tell the app whether it leads.

Library use: build :class:`sidecar.settings.Settings` with :func:`sidecar.config.load`,
then run a :class:`sidecar.runtime.Sidecar`, or drive a single
:class:`sidecar.elector.Elector` over a backend from :func:`sidecar.lease.create_backend`.
"""

# The one version source: pyproject.toml reads it (dynamic), and so do --version and the
# lease_sidecar_build_info metric. The chart's appVersion is held equal by a test.
__version__ = "0.1.0"
