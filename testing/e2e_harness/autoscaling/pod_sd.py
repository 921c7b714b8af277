"""Kubernetes pod discovery for a Prometheus built without `kubernetes_sd_configs`.

Debian's `prometheus` package (2.42.0+ds) leaves the Kubernetes service discovery out (its
client libraries are not packaged), so `kubernetes_sd_configs` is an unknown field there.
This bridge serves Prometheus's generic `http_sd_configs` from the test API server with the
same target groups and `__meta_kubernetes_pod_*` labels the pod role produces (one target
per declared container port, address <pod IP>:<port>), so the scrape job's relabelling is
the unchanged `kubernetes-pods` job a cluster uses. With an upstream Prometheus, which has
the Kubernetes SD, prometheus.py uses `kubernetes_sd_configs` directly and this is not started.

It lists pods on every refresh (Prometheus asks every 2 s) with its own client certificate,
allowed to list pods and nothing else.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kubernetes import client

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def _name(s: str) -> str:
    """Prometheus's label-name sanitising (strutil.SanitizeLabelName)."""
    return _UNSAFE.sub("_", s)


def pod_target_groups(pods: list[client.V1Pod]) -> list[dict]:
    """What the pod role yields: one group per pod, one target per container port."""
    groups = []
    for pod in pods:
        meta, spec, status = pod.metadata, pod.spec, pod.status
        if not (status and status.pod_ip):
            continue  # the pod role gives such pods no address to scrape either
        ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
        labels = {
            "__meta_kubernetes_namespace": meta.namespace,
            "__meta_kubernetes_pod_name": meta.name,
            "__meta_kubernetes_pod_ip": status.pod_ip,
            "__meta_kubernetes_pod_uid": meta.uid,
            "__meta_kubernetes_pod_phase": status.phase or "",
            "__meta_kubernetes_pod_ready": "true" if ready else "false",
            "__meta_kubernetes_pod_node_name": spec.node_name or "",
            "__meta_kubernetes_pod_host_ip": status.host_ip or "",
        }
        for k, v in (meta.labels or {}).items():
            labels[f"__meta_kubernetes_pod_label_{_name(k)}"] = v
            labels[f"__meta_kubernetes_pod_labelpresent_{_name(k)}"] = "true"
        for k, v in (meta.annotations or {}).items():
            labels[f"__meta_kubernetes_pod_annotation_{_name(k)}"] = v
            labels[f"__meta_kubernetes_pod_annotationpresent_{_name(k)}"] = "true"
        for c in spec.containers:
            for p in c.ports or []:
                groups.append({
                    "targets": [f"{status.pod_ip}:{p.container_port}"],
                    "labels": {
                        **labels,
                        "__meta_kubernetes_pod_container_name": c.name,
                        "__meta_kubernetes_pod_container_port_name": p.name or "",
                        "__meta_kubernetes_pod_container_port_number": str(p.container_port),
                        "__meta_kubernetes_pod_container_port_protocol": p.protocol or "TCP",
                    },
                })  # fmt: skip
    return groups


class PodDiscovery:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.errors: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/targets"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pod-sd", daemon=True
        )

    def start(self) -> PodDiscovery:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        sd = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                try:
                    body = json.dumps(
                        pod_target_groups(sd.core.list_pod_for_all_namespaces().items)
                    )
                    code = 200
                except Exception as e:  # Prometheus keeps the last good targets on errors
                    sd.errors.append(f"{type(e).__name__}: {e}")
                    body, code = json.dumps({"error": str(e)}), 500
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
