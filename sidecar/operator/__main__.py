"""``lease-sidecar operator``: the admission webhook and the label reconciler in one kopf
process (see :mod:`sidecar.operator`).

Takes the injector's flags (``--spec`` and the TLS ones; without ``--spec`` no webhook
is served, only the labels are kept) and ``--namespace`` (repeatable): the namespaces
whose lease groups it keeps, one pod watch each; without it, one cluster-wide watch.
"""

from __future__ import annotations

import logging
import sys

import kopf

from sidecar.base import jsonlog
from sidecar.config import parse_addr
from sidecar.injector import __main__ as injector
from sidecar.injector import flags, webhook
from sidecar.kubeapi import KubeClient, KubeError
from sidecar.operator.reconciler import Reconciler, register

log = logging.getLogger("sidecar.operator")


def main(argv: list[str] | None = None) -> int:
    parser = flags.operator_parser()
    args = parser.parse_args(argv)
    if args.spec:
        flags.check(parser, args)
    jsonlog.setup(args.log_level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        client = KubeClient.connect()
    except KubeError as exc:
        print(f"lease-sidecar operator: error: {exc}", file=sys.stderr)
        return 2
    registry = webhook.build_registry()
    register(registry, Reconciler(client))
    if args.spec:
        served = injector.serve(args, registry)
        if served is None:
            return 2
        settings, liveness = served
    else:
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True  # one discovery at start; no CRD watches
        settings.posting.enabled = False  # our own log lines say what was put right
        try:
            health_host, health_port = parse_addr(args.health)
        except ValueError as exc:
            print(f"lease-sidecar operator: error: --health: {exc}", file=sys.stderr)
            return 2
        liveness = f"http://{health_host}:{health_port}/healthz"
    settings.watching.server_timeout = 300  # seconds: a watch request is re-opened after
    log.info("operator starting", extra={"namespaces": args.namespace or "all",
                                         "webhook": bool(args.spec)})
    kopf.run(registry=registry, settings=settings, standalone=True,
             clusterwide=not args.namespace, namespaces=args.namespace or (),
             liveness_endpoint=liveness)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
