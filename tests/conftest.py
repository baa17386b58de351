"""Shared fixtures. Test-bed plugins (real PostgreSQL, real kube-apiserver, the one-node
cluster that runs real pods) register here."""

pytest_plugins: list[str] = [
    "tests.testbed.pg_fixtures",
    "tests.testbed.pgbouncer_fixtures",
    "tests.testbed.kube_fixtures",
    "tests.testbed.cluster_fixtures",
]
