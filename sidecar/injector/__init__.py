"""Sidecar injection: a kopf mutating admission webhook that adds the lease sidecar
(the same one the Helm chart renders) to Pods labelled ``lease-sidecar/inject=true``.

Run with ``python -m sidecar.injector``; needs the ``injector`` extra (kopf, kubernetes,
cryptography). Nothing here is imported by the sidecar itself.
"""
