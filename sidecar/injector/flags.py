"""The flags of ``python -m sidecar.injector`` and ``lease-sidecar operator``.

Kept apart from the modules that run them, which import kopf: ``lease-sidecar operator
--help`` prints these flags where the ``injector`` extra is not installed (the sidecar
image), and only running the operator needs it.
"""

from __future__ import annotations

import argparse

OPERATOR_TEXT = ("Inject the lease sidecar into opted-in Pods and keep their lease-role "
                 "labels true.")


def parser_for(prog: str = "python -m sidecar.injector",
               text: str = "Inject the lease sidecar into opted-in Pods.",
               spec_required: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=text)
    parser.add_argument("--spec", required=spec_required,
                        help="the chart-rendered sidecar spec (JSON)")
    parser.add_argument("--listen", default="0.0.0.0:8443", help="HTTPS host:port")
    parser.add_argument("--health", default="0.0.0.0:8080",
                        help="host:port of the liveness endpoint (/healthz)")
    parser.add_argument("--tls-file", help="PEM file with the serving certificate (and its key, "
                                           "unless --tls-key names another file)")
    parser.add_argument("--tls-key", help="PEM file with the serving key (with --tls-file)")
    parser.add_argument("--tls-secret", help="NAMESPACE/NAME of the Secret holding the TLS")
    parser.add_argument("--host", action="append", default=[],
                        help="DNS name or IP the serving certificate must name (repeatable)")
    parser.add_argument("--webhook-config",
                        help="MutatingWebhookConfiguration whose caBundle to keep current")
    parser.add_argument("--cert-dir", default=None,
                        help="private directory for the serving PEM (default: under /tmp)")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    return parser


def operator_parser() -> argparse.ArgumentParser:
    """``lease-sidecar operator``'s flags: the injector's (the webhook is optional) and
    ``--namespace``."""
    parser = parser_for(prog="lease-sidecar operator", text=OPERATOR_TEXT, spec_required=False)
    parser.add_argument("--namespace", action="append", default=[],
                        help="keep the labels in this namespace (repeatable; default: all)")
    return parser


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if bool(args.tls_file) == bool(args.tls_secret):
        parser.error("give exactly one of --tls-file and --tls-secret")
    if args.tls_secret and ("/" not in args.tls_secret or not args.host):
        parser.error("--tls-secret needs NAMESPACE/NAME and at least one --host")
    if args.tls_key and not args.tls_file:
        parser.error("--tls-key goes with --tls-file")
