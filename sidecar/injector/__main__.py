"""``python -m sidecar.injector``: serve the sidecar-injection webhook.

Two ways to get the serving certificate:

* ``--tls-secret NS/NAME --host HOST ...`` (what the chart does): keep a CA and serving
  certificate in that Secret, renewing them when needed, and with ``--webhook-config``
  keep the webhook's ``caBundle`` pointing at the CA (see :mod:`sidecar.injector.tls`);
* ``--tls-file PEM`` (with ``--tls-key KEY`` when the key is a file of its own, as in
  the Secret cert-manager keeps): a certificate managed elsewhere; reloaded when the
  files change.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import kopf

from sidecar.base import jsonlog
from sidecar.config import parse_addr
from sidecar.injector import tls, webhook
from sidecar.injector.flags import check, parser_for
from sidecar.injector.inject import InjectionSpec

log = logging.getLogger("sidecar.injector")

RENEW_EVERY = 6 * 3600.0  # far below the 30-day renewal margin; cheap when nothing changes
_background: set[asyncio.Task[None]] = set()


def _refresh_tls(args: argparse.Namespace, cert_dir: Path) -> Path:
    namespace, _, name = args.tls_secret.partition("/")
    api = tls.api_client()
    try:
        bundle = tls.ensure_secret(api, namespace, name, args.host)
        if args.webhook_config:
            tls.ensure_ca_bundle(api, args.webhook_config, bundle.ca_cert)
    finally:
        api.close()
    return tls.write_pem(bundle, cert_dir)


def serve(args: argparse.Namespace, registry: kopf.OperatorRegistry
          ) -> tuple[kopf.OperatorSettings, str] | None:
    """Add the webhook to ``registry``; kopf's settings and the liveness endpoint, or None
    (after printing why) if a setting is wrong. Used by :mod:`sidecar.operator` too."""
    try:
        spec = InjectionSpec.load(args.spec)
        host, port = parse_addr(args.listen)
        health_host, health_port = parse_addr(args.health)
    except ValueError as exc:
        print(f"lease-sidecar-injector: error: {exc}", file=sys.stderr)
        return None
    cert_dir = Path(args.cert_dir or tempfile.mkdtemp(prefix="lease-injector-tls-"))
    pem = Path(args.tls_file) if args.tls_file else _refresh_tls(args, cert_dir)
    key = Path(args.tls_key) if args.tls_key else pem

    webhook.add_handlers(registry, spec)
    if args.tls_secret:
        @kopf.on.startup(registry=registry)
        async def keep_tls_fresh(**_: Any) -> None:
            async def loop() -> None:
                while True:
                    await asyncio.sleep(RENEW_EVERY)
                    try:
                        await asyncio.to_thread(_refresh_tls, args, cert_dir)
                    except Exception:  # keep serving the current certificate; retry later
                        log.exception("TLS renewal failed")

            # A task, not an awaited loop: startup handlers must finish for kopf to serve.
            # The set keeps a reference so the task is not garbage-collected.
            _background.add(asyncio.get_running_loop().create_task(loop()))

    # kopf reloads the PEM when it changes (checked every file_check_interval seconds).
    server = webhook.InjectorServer(addr=host, port=port, certfile=pem, pkeyfile=key,
                                    file_check_interval=60.0)
    return webhook.settings(server), f"http://{health_host}:{health_port}/healthz"


def main(argv: list[str] | None = None) -> int:
    parser = parser_for()
    args = parser.parse_args(argv)
    check(parser, args)
    jsonlog.setup(args.log_level)
    # One line per admission call and probe would drown the decisions that matter.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    registry = webhook.build_registry()
    served = serve(args, registry)
    if served is None:
        return 2
    settings, liveness = served
    kopf.run(registry=registry, settings=settings, clusterwide=True, standalone=True,
             liveness_endpoint=liveness)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
