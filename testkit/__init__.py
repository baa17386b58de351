"""Support shared by the tests and the benchmarks: real sidecar processes, the test bed
(PostgreSQL, PgBouncer, kube-apiserver, the one-node cluster, the image) and the chaos
harness.

Layers (``tests/unit/test_support_layers.py`` enforces them): ``testkit`` imports neither
``tests`` nor ``bench``; ``tests`` and ``bench`` import ``testkit`` and never each other.
pytest fixtures stay under ``tests/``. Not part of the installed package.
"""
