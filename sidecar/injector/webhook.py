"""The kopf mutating admission webhook that injects the sidecar into opted-in Pods.

The MutatingWebhookConfiguration belongs to the Helm chart (kopf's "managed" mode is
off): the chart sets the objectSelector, so the apiserver sends only Pods labelled
``lease-sidecar/inject=true``, and the failure policy. The handler checks the label again
(``labels=`` below and in :func:`sidecar.injector.inject.inject`), so a misconfigured
webhook still never changes a Pod that did not opt in.

The URL path is the handler id: ``https://<service>/lease-sidecar-inject``.

Only ``CREATE`` is mutated: the chart's rules send nothing else, and the server and the
handler both check again (kopf itself does not filter reviews by the handler's
``operations``). A body that is not a well-formed AdmissionReview for v1 pods is answered
with an AdmissionReview denial (or, without a ``uid`` to answer to, a plain ``400``) that
names what is wrong in one line; a failure of ours is logged with its traceback and
answered without it.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, cast

import kopf
from aiohttp import web

from sidecar.injector import tls
from sidecar.injector.inject import OPT_IN_LABEL, InjectionError, InjectionSpec, inject
from sidecar.kube import kopf_connection

HANDLER_ID = "lease-sidecar-inject"
PATH = f"/{HANDLER_ID}"
API_VERSION = "admission.k8s.io/v1"
PODS = {"group": "", "version": "v1", "resource": "pods"}

log = logging.getLogger("sidecar.injector")


def review_problem(review: Any) -> str | None:
    """Why ``review`` is not an AdmissionReview of a v1 Pod we can answer; None if it is."""
    if not isinstance(review, dict):
        return "the body is not a JSON object"
    if review.get("apiVersion") != API_VERSION or review.get("kind") != "AdmissionReview":
        return f"the body is not an {API_VERSION} AdmissionReview"
    request = review.get("request")
    if not isinstance(request, dict):
        return "request is missing or not a map"
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        return "request.uid is missing"
    resource = request.get("resource")
    if not isinstance(resource, dict) or {k: resource.get(k) for k in PODS} != PODS:
        return "this webhook reviews only v1 pods (request.resource)"
    if request.get("operation") not in ("CREATE", "UPDATE", "DELETE", "CONNECT"):
        return "request.operation is not CREATE, UPDATE, DELETE or CONNECT"
    if not isinstance(request.get("userInfo"), dict):
        return "request.userInfo is missing or not a map"
    for key in ("object", "oldObject"):
        if request.get(key) is not None and not isinstance(request[key], dict):
            return f"request.{key} is not a map"
    if request["operation"] == "CREATE" and request.get("object") is None:
        return "request.object is missing"
    return None


def answer(uid: str, allowed: bool, code: int = 200, message: str = "") -> dict[str, Any]:
    """An AdmissionReview response (without a patch)."""
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": code, "message": message}
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


class InjectorServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, with the review checked before kopf sees it.

    Overrides kopf's ``_serve`` (the one place that reads the request), because kopf
    answers a malformed review with a 500 (or its exception text as the reason).
    tests/unit/test_webhook.py pins this against the installed kopf.
    """

    @staticmethod
    async def _serve(fn: Any, request: web.Request) -> web.Response:
        try:
            review = json.loads(await request.text())
        except (ValueError, UnicodeDecodeError):
            return web.Response(status=400, text="the body is not a JSON AdmissionReview\n")
        problem = review_problem(review)
        uid = ((review.get("request") or {}).get("uid")
               if isinstance(review, dict) and isinstance(review.get("request"), dict)
               else None)
        if problem:
            log.info("refused a malformed admission review", extra={"problem": problem})
            if isinstance(uid, str) and uid:
                return web.json_response(answer(uid, False, 400, problem))
            return web.Response(status=400, text=problem + "\n")
        assert isinstance(uid, str)  # review_problem made sure of it
        if review["request"]["operation"] != "CREATE":
            return web.json_response(answer(uid, True))  # never mutate an existing Pod
        try:
            response = await fn(review, webhook=request.match_info.get("id"),
                                sslpeer=(request.transport.get_extra_info("peercert")
                                         if request.transport else None),
                                headers=dict(request.headers))
        except Exception:
            log.exception("admission review failed")
            return web.json_response(answer(uid, False, 500,
                                            "the injector failed on this pod; see its log"))
        return web.json_response(response)


def build_registry() -> kopf.OperatorRegistry:
    """A registry holding only the login (handlers: :func:`add_handlers`, and the
    operator's label reconciler)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo | None:
        # The one credentials rule of sidecar.kube: KUBECONFIG, else the ServiceAccount.
        return kopf_connection(tls.api_client().configuration, None)

    return registry


def add_handlers(registry: kopf.OperatorRegistry, spec: InjectionSpec) -> None:
    """The injection handler."""

    @kopf.on.mutate("pods", id=HANDLER_ID, operations=["CREATE"],
                    labels={OPT_IN_LABEL: "true"}, side_effects=False, registry=registry)
    def inject_sidecar(body: kopf.Body, patch: kopf.Patch, logger: Any,
                       operation: str | None = None, **_: Any) -> None:
        if operation != "CREATE":
            return  # kopf does not filter by operations=; a running Pod is never changed
        pod = copy.deepcopy(dict(body))
        try:
            changed = inject(pod, spec)
        except InjectionError as exc:
            # The Pod asked for a sidecar but configured it wrongly: refuse it loudly.
            raise kopf.AdmissionError(str(exc), code=400) from None
        except Exception:
            # A bug of ours: the traceback goes to our log, not to whoever created the Pod.
            logger.exception("injection failed")
            raise kopf.AdmissionError("the injector failed on this pod; see its log",
                                      code=500) from None
        if not changed:
            return
        logger.info("injecting %s into the pod", spec.container_name)

        # kopf diffs the original body against what these functions make of it and
        # answers with the JSON patch; replacing the whole body keeps list order exact.
        def replace(raw: kopf.RawBody) -> None:
            body = cast(dict[str, Any], raw)  # kopf's TypedDict over the plain dict it passes
            body.clear()
            body.update(copy.deepcopy(pod))

        patch.fns.append(replace)


def settings(server: kopf.WebhookServer) -> kopf.OperatorSettings:
    """Webhook-only operation: no watches, no events, no cluster-wide scanning."""
    result = kopf.OperatorSettings()
    result.admission.server = server
    result.admission.managed = None  # the chart owns the webhook configuration
    result.scanning.disabled = True  # one discovery at start; no CRD/namespace watches
    result.posting.enabled = False  # k8s Events would need extra RBAC and add nothing
    return result
