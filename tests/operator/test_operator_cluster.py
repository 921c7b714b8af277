"""KubeCluster speaks real HTTP: paths, verbs, content types, field manager, 404 handling.
A loopback HTTP server stands in for the API server and records what it receives."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from sluice_operator.cluster import KubeCluster


class Recorder(BaseHTTPRequestHandler):
    requests: list = []
    responses: dict = {}

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        type(self).requests.append(
            {
                "method": self.command,
                "path": self.path,
                "type": self.headers.get("Content-Type"),
                "body": body,
            }
        )
        status, payload = type(self).responses.get(
            (self.command, self.path.split("?")[0]), (200, {"ok": True})
        )
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_DELETE = do_POST = _handle

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


@pytest.fixture
def api(server):
    Recorder.requests, Recorder.responses = [], {}
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
    cfg.api_key = {"authorization": "secret-token"}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return KubeCluster(client.ApiClient(cfg)), Recorder


def test_apply_is_server_side_apply_with_field_manager(api):
    cluster, rec = api
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "m", "namespace": "ns"},
    }
    assert cluster.apply(manifest) == {"ok": True}
    (req,) = rec.requests
    assert req["method"] == "PATCH"
    assert (
        req["path"]
        == "/apis/apps/v1/namespaces/ns/deployments/m?fieldManager=sluice-operator&force=true"
    )
    assert req["type"] == "application/apply-patch+yaml"
    assert json.loads(req["body"]) == manifest


@pytest.mark.parametrize(
    "api_version,kind,path",
    [
        ("v1", "Service", "/api/v1/namespaces/ns/services/m"),
        ("networking.k8s.io/v1", "Ingress", "/apis/networking.k8s.io/v1/namespaces/ns/ingresses/m"),
        (
            "autoscaling/v2",
            "HorizontalPodAutoscaler",
            "/apis/autoscaling/v2/namespaces/ns/horizontalpodautoscalers/m",
        ),
        (
            "policy/v1",
            "PodDisruptionBudget",
            "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/m",
        ),
        (
            "serving.sluice.dev/v1alpha1",
            "StreamingModel",
            "/apis/serving.sluice.dev/v1alpha1/namespaces/ns/streamingmodels/m",
        ),
    ],
)
def test_get_paths_and_404_is_none(api, api_version, kind, path):
    cluster, rec = api
    rec.responses[("GET", path)] = (404, {"kind": "Status", "code": 404})
    assert cluster.get(api_version, kind, "ns", "m") is None
    assert rec.requests[0]["path"] == path


def test_get_other_errors_raise(api):
    cluster, rec = api
    rec.responses[("GET", "/api/v1/namespaces/ns/services/m")] = (
        403,
        {"kind": "Status", "code": 403},
    )
    with pytest.raises(ApiException) as info:
        cluster.get("v1", "Service", "ns", "m")
    assert info.value.status == 403


def test_delete_tolerates_404(api):
    cluster, rec = api
    rec.responses[("DELETE", "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/m")] = (404, {})
    cluster.delete("policy/v1", "PodDisruptionBudget", "ns", "m")
    assert rec.requests[0]["method"] == "DELETE"


def test_list_pods_uses_label_selector(api):
    cluster, rec = api
    rec.responses[("GET", "/api/v1/namespaces/ns/pods")] = (
        200,
        {"items": [{"metadata": {"name": "p"}}]},
    )
    assert cluster.list_pods("ns", "a=b,c=d") == [{"metadata": {"name": "p"}}]
    assert rec.requests[0]["path"] == "/api/v1/namespaces/ns/pods?labelSelector=a%3Db%2Cc%3Dd"


def test_status_is_a_merge_patch_on_the_subresource(api):
    cluster, rec = api
    patch = {"phase": "Ready", "autoscaling": {"message": None}, "endpoints": {"websocket": None}}
    cluster.patch_status("ns", "m", patch)
    (req,) = rec.requests
    assert req["path"] == "/apis/serving.sluice.dev/v1alpha1/namespaces/ns/streamingmodels/m/status"
    assert req["type"] == "application/merge-patch+json"
    # The nulls reach the API server (they are what deletes a vanished key).
    assert json.loads(req["body"]) == {"status": patch}


def test_apply_rejection_carries_status_for_the_handler(api):
    cluster, rec = api
    path = "/apis/apps/v1/namespaces/ns/deployments/m"
    rec.responses[("PATCH", path)] = (
        422,
        {"kind": "Status", "code": 422, "message": "spec.template: Invalid"},
    )
    with pytest.raises(ApiException) as info:
        cluster.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "m", "namespace": "ns"},
            }
        )
    assert info.value.status == 422 and "spec.template: Invalid" in info.value.body
