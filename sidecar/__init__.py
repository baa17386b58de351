"""lease-sidecar: hold a distributed lease for this pod and tell the app whether it leads.

Library use: build :class:`sidecar.config.Settings` with :func:`sidecar.config.load`,
then run a :class:`sidecar.runtime.Sidecar`, or drive a single
:class:`sidecar.elector.Elector` over a backend from :func:`sidecar.lease.create_backend`.
"""

__version__ = "0.1.0"
