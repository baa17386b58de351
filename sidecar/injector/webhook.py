"""The kopf mutating admission webhook that injects the sidecar into opted-in Pods.

The MutatingWebhookConfiguration belongs to the Helm chart (kopf's "managed" mode is
off): the chart sets the objectSelector, so the apiserver sends only Pods labelled
``lease-sidecar/inject=true``, and the failure policy. The handler checks the label again
(``labels=`` below and in :func:`sidecar.injector.inject.inject`), so a misconfigured
webhook still never changes a Pod that did not opt in.

The URL path is the handler id: ``https://<service>/lease-sidecar-inject``.
"""

from __future__ import annotations

import copy
from typing import Any

import kopf

from sidecar.injector.inject import OPT_IN_LABEL, InjectionError, InjectionSpec, inject

HANDLER_ID = "lease-sidecar-inject"
PATH = f"/{HANDLER_ID}"


def build_registry(spec: InjectionSpec) -> kopf.OperatorRegistry:
    """A registry holding only the injection handler and the login."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The kubernetes client's rules: in-cluster ServiceAccount, else $KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    @kopf.on.mutate("pods", id=HANDLER_ID, operations=["CREATE"],
                    labels={OPT_IN_LABEL: "true"}, side_effects=False, registry=registry)
    def inject_sidecar(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        pod = copy.deepcopy(dict(body))
        try:
            changed = inject(pod, spec)
        except InjectionError as exc:
            # The Pod asked for a sidecar but configured it wrongly: refuse it loudly.
            raise kopf.AdmissionError(str(exc), code=400) from None
        if not changed:
            return
        logger.info("injecting %s into the pod", spec.container_name)

        # kopf diffs the original body against what these functions make of it and
        # answers with the JSON patch; replacing the whole body keeps list order exact.
        def replace(raw: dict[str, Any]) -> None:
            raw.clear()
            raw.update(copy.deepcopy(pod))

        patch.fns.append(replace)

    return registry


def settings(server: kopf.WebhookServer) -> kopf.OperatorSettings:
    """Webhook-only operation: no watches, no events, no cluster-wide scanning."""
    result = kopf.OperatorSettings()
    result.admission.server = server
    result.admission.managed = None  # the chart owns the webhook configuration
    result.scanning.disabled = True  # one discovery at start; no CRD/namespace watches
    result.posting.enabled = False  # k8s Events would need extra RBAC and add nothing
    return result
