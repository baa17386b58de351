"""The injector's review checks, in front of kopf (the full path: tests/integration).

``InjectorServer._serve`` runs in a real aiohttp server on loopback; kopf's own admission
engine behind it is replaced by a recorder here (it needs a cluster's discovery to run),
and is exercised for real against the apiserver in tests/integration/test_injector.py.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import aiohttp
import kopf
import pytest
from aiohttp import web

from sidecar.injector.webhook import InjectorServer, review_problem
from tests.unit.loopback import serve_on_loopback


def review(operation: str = "CREATE", **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u-1", "operation": operation,
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "userInfo": {"username": "admin"},
            "object": {"metadata": {"name": "p", "labels": {"lease-sidecar/inject": "true"}},
                       "spec": {"containers": [{"name": "app"}]}},
        },
    }
    body["request"].update(changes)
    return body


def test_kopf_still_serves_through_the_method_we_override() -> None:
    assert "self._serve(fn, request)" in inspect.getsource(kopf.WebhookServer.__call__)
    assert issubclass(InjectorServer, kopf.WebhookServer)


@pytest.mark.parametrize(("body", "problem"), [
    ([], "the body is not a JSON object"),
    ({"kind": "AdmissionReview"}, "is not an admission.k8s.io/v1 AdmissionReview"),
    ({**review(), "request": "x"}, "request is missing or not a map"),
    (review(uid=""), "request.uid is missing"),
    (review(uid=7), "request.uid is missing"),
    (review(resource={"group": "apps", "version": "v1", "resource": "deployments"}),
     "reviews only v1 pods"),
    (review(resource="pods"), "reviews only v1 pods"),
    (review(operation="PATCH"), "request.operation is not"),
    (review(userInfo=None), "request.userInfo is missing"),
    (review(object="pod"), "request.object is not a map"),
    (review(object=None), "request.object is missing"),
    (review(oldObject=[1]), "request.oldObject is not a map"),
])
def test_review_problems(body: Any, problem: str) -> None:
    found = review_problem(body)
    assert found is not None and problem in found and "\n" not in found


def test_good_reviews_have_no_problem() -> None:
    assert review_problem(review()) is None
    assert review_problem(review("UPDATE", oldObject={"metadata": {}})) is None
    assert review_problem(review("DELETE", object=None, oldObject={"metadata": {}})) is None


@pytest.fixture
async def served():
    calls: list[dict[str, Any]] = []

    async def engine(request: dict[str, Any], **_: Any) -> dict[str, Any]:
        calls.append(copy.deepcopy(request))
        if request["request"]["object"]["metadata"]["name"] == "boom":
            raise KeyError("secret internals")
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": request["request"]["uid"], "allowed": True,
                             "patchType": "JSONPatch", "patch": "W10="}}

    async def handle(request: web.Request) -> web.Response:
        return await InjectorServer._serve(engine, request)

    app = web.Application()
    app.router.add_post("/{id:.*}", handle)
    runner, url = await serve_on_loopback(app)
    session = aiohttp.ClientSession(url)
    yield session, calls
    await session.close()
    await runner.cleanup()


async def test_create_goes_to_kopf(served) -> None:
    session, calls = served
    response = await session.post("/lease-sidecar-inject", json=review())
    assert response.status == 200
    assert (await response.json())["response"]["patch"] == "W10="
    assert len(calls) == 1


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT"])
async def test_other_operations_are_allowed_unchanged(served, operation: str) -> None:
    """Before: kopf ran the mutating handler for UPDATE reviews too."""
    session, calls = served
    response = await session.post("/lease-sidecar-inject",
                                  json=review(operation, oldObject={"metadata": {}}))
    assert response.status == 200
    body = await response.json()
    assert body["response"] == {"uid": "u-1", "allowed": True}
    assert calls == []


@pytest.mark.parametrize(("raw", "status", "text"), [
    (b"not json", 400, "the body is not a JSON AdmissionReview"),
    (b"[]", 400, "the body is not a JSON object"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', 400,
     "request is missing or not a map"),
    (b"\xff\xfe", 400, "the body is not a JSON AdmissionReview"),
])
async def test_malformed_without_uid_is_a_plain_400(served, raw: bytes, status: int,
                                                    text: str) -> None:
    session, calls = served
    response = await session.post("/lease-sidecar-inject", data=raw,
                                  headers={"Content-Type": "application/json"})
    assert response.status == status
    body = await response.text()
    assert text in body and "Traceback" not in body and "Error" not in body
    assert calls == []


async def test_malformed_with_uid_is_an_admission_denial(served) -> None:
    session, calls = served
    response = await session.post("/lease-sidecar-inject", json=review(userInfo="x"))
    assert response.status == 200
    body = await response.json()
    assert body["kind"] == "AdmissionReview" and body["response"]["uid"] == "u-1"
    assert body["response"]["allowed"] is False
    assert body["response"]["status"] == {
        "code": 400, "message": "request.userInfo is missing or not a map"}
    assert calls == []


async def test_a_failure_of_ours_is_a_denial_without_exception_text(served) -> None:
    session, _ = served
    bad = review()
    bad["request"]["object"]["metadata"]["name"] = "boom"
    response = await session.post("/lease-sidecar-inject", json=bad)
    assert response.status == 200
    body = await response.json()
    assert body["response"]["allowed"] is False and body["response"]["status"]["code"] == 500
    assert "secret internals" not in await response.text()
