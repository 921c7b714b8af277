"""A test stand-in for prometheus-adapter: `custom.metrics.k8s.io/v1beta2` from the chart's rule.

In a cluster, prometheus-adapter serves the custom metrics API with the rules the chart
ships (charts/sluice-operator/files/prometheus-adapter-rules.yaml). Here this small server
does the part of prometheus-adapter the HPA depends on, from the same file:

- discovery: one `pods/<name.as>` resource per rule;
- `GET .../namespaces/<ns>/pods/<name or *>/<metric>?labelSelector=...`: list the pods (for
  `*`, by the selector, with its own client certificate and RBAC), expand the rule's
  `metricsQuery` exactly as prometheus-adapter does (`<<.LabelMatchers>>` =
  `namespace="<ns>",pod=~"<a>|<b>"`, `<<.GroupBy>>` = `pod`), run it on Prometheus, and
  answer one MetricValue per pod in the result (milli-units, as prometheus-adapter rounds).
  Pods without a sample are left out: the HPA then treats them as missing, as it would with
  the real adapter. NaN samples are recorded in `anomalies` (the real adapter would hand the
  HPA garbage) so a test can fail on them.

It is an aggregated API server like the real one: TLS with a serving certificate for
`<service>.<namespace>.svc` (the APIService carries its CA), and it only answers the
kube-apiserver's front proxy (client certificate from the requestheader CA, CN
front-proxy-client, X-Remote-User set). The APIService points at an ExternalName Service
for 127.0.0.1: EndpointSlices refuse loopback addresses, and the aggregator resolves
ExternalName Services without them.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import re
import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml
from kubernetes import client
from testkit.repo import ROOT

from ..kube import eventually
from ..pki import CertificateAuthority
from .cluster import FRONT_PROXY_USER
from .prometheus import Prometheus

RULES_FILE = ROOT / "charts/sluice-operator/files/prometheus-adapter-rules.yaml"
GROUP, VERSION = "custom.metrics.k8s.io", "v1beta2"
NAMESPACE, SERVICE = "custom-metrics", "sluice-test-adapter"
USER = "e2e-metrics-adapter"
_PATH = re.compile(rf"^/apis/{re.escape(GROUP)}/{VERSION}/namespaces/([^/]+)/pods/([^/]+)/([^/]+)$")
_TEMPLATE = re.compile(r"<<\s*\.(\w+)\s*>>")


def load_rules(path: Path = RULES_FILE) -> dict[str, str]:
    """metric name -> metricsQuery, for the pod rules of the file."""
    out = {}
    for rule in yaml.safe_load(path.read_text())["rules"]:
        overrides = rule["resources"]["overrides"]
        if overrides.get("pod") != {"resource": "pod"}:
            raise ValueError(f"rule {rule['name']} is not a pod metric")
        out[rule["name"]["as"]] = rule["metricsQuery"]
    return out


def expand(query: str, namespace: str, pods: list[str]) -> str:
    """prometheus-adapter's template expansion for a namespaced pod query."""
    values = {
        "LabelMatchers": f'namespace="{namespace}",pod=~"{"|".join(pods)}"',
        "GroupBy": "pod",
    }

    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ValueError(f"template field {m.group(0)} is not supported by the test adapter")
        return values[m.group(1)]

    return _TEMPLATE.sub(sub, query)


def milli_quantity(value: float) -> str:
    return f"{int(value * 1000.0)}m"


class CustomMetricsAdapter:
    def __init__(self, workdir: Path, prometheus: Prometheus, kube: client.ApiClient,
                 front_proxy_ca: Path, rules_file: Path = RULES_FILE) -> None:  # fmt: skip
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.prometheus = prometheus
        self.core = client.CoreV1Api(kube)
        self.rules = load_rules(rules_file)
        self.ca = CertificateAuthority(workdir / "pki", name="sluice-test-adapter-ca")
        self.serving = self.ca.serving(
            "adapter", dns=[f"{SERVICE}.{NAMESPACE}.svc", "localhost"], ips=["127.0.0.1"]
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.serving.cert, self.serving.key)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(front_proxy_ca))
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.requests: list[dict] = []  # every metric request: time, user, metric, values
        self.anomalies: list[str] = []
        self.refused = 0

    def start(self) -> CustomMetricsAdapter:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="adapter", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever: only if it runs
            self._server.shutdown()
        self._server.server_close()

    # --- the API --------------------------------------------------------------------
    def discovery(self) -> dict:
        return {
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{VERSION}",
            "resources": [
                {"name": f"pods/{name}", "singularName": "", "namespaced": True,
                 "kind": "MetricValueList", "verbs": ["get"]}
                for name in sorted(self.rules)
            ],
        }  # fmt: skip

    def metric_values(self, namespace: str, name: str, metric: str, selector: str) -> dict:
        query = self.rules[metric]
        if name == "*":
            pods = [p.metadata.name for p in
                    self.core.list_namespaced_pod(namespace, label_selector=selector or None).items]  # fmt: skip
        else:
            pods = [name]
        items = []
        values: dict[str, float] = {}
        if pods:
            expr = expand(query, namespace, sorted(pods))
            now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            for sample in self.prometheus.query(expr):
                pod = sample["metric"].get("pod")
                value = float(sample["value"][1])
                if pod not in pods:
                    self.anomalies.append(f"{metric}: result for unknown pod {sample['metric']}")
                    continue
                if math.isnan(value) or math.isinf(value):
                    self.anomalies.append(f"{metric}: {value} for pod {pod}")
                    continue
                values[pod] = value
                items.append({
                    "describedObject": {"kind": "Pod", "namespace": namespace, "name": pod,
                                        "apiVersion": "/v1"},
                    "metric": {"name": metric, "selector": None},
                    "timestamp": now,
                    "windowSeconds": 60,
                    "value": milli_quantity(value),
                })  # fmt: skip
        with self.lock:
            self.requests.append({"time": time.time(), "namespace": namespace, "metric": metric,
                                  "pods": sorted(pods), "values": values})  # fmt: skip
        return {"kind": "MetricValueList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {},
                "items": items}  # fmt: skip

    # --- registration -----------------------------------------------------------------
    def register(self, admin: client.ApiClient, timeout: float = 60.0) -> None:
        """RBAC to list pods, the ExternalName Service, the APIService; wait until Available."""
        core = client.CoreV1Api(admin)
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_cluster_role(client.V1ClusterRole(
            metadata=client.V1ObjectMeta(name=USER),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list"])],
        ))  # fmt: skip
        rbac.create_cluster_role_binding(client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=USER),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=USER),
            subjects=[client.RbacV1Subject(kind="User", name=USER, api_group="rbac.authorization.k8s.io")],
        ))  # fmt: skip
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        core.create_namespaced_service(NAMESPACE, client.V1Service(
            metadata=client.V1ObjectMeta(name=SERVICE),
            spec=client.V1ServiceSpec(type="ExternalName", external_name="127.0.0.1"),
        ))  # fmt: skip
        registration = client.ApiregistrationV1Api(admin)
        registration.create_api_service(client.V1APIService(
            metadata=client.V1ObjectMeta(name=f"{VERSION}.{GROUP}"),
            spec=client.V1APIServiceSpec(
                group=GROUP, version=VERSION, group_priority_minimum=100, version_priority=200,
                service=client.ApiregistrationV1ServiceReference(
                    namespace=NAMESPACE, name=SERVICE, port=self.port),
                ca_bundle=base64.b64encode(self.ca.cert_path.read_bytes()).decode(),
            ),
        ))  # fmt: skip

        def available():  # the condition itself, for the message while it is not True
            got = registration.read_api_service(f"{VERSION}.{GROUP}")
            cond = next((c for c in got.status.conditions or [] if c.type == "Available"), None)
            assert cond is not None and cond.status == "True", cond
            return True

        eventually(available, timeout=timeout, interval=0.5,
                   message=f"APIService {VERSION}.{GROUP} Available")  # fmt: skip


def _handler(adapter: CustomMetricsAdapter):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean; requests are recorded
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _status(self, code: int, reason: str, message: str) -> None:
            self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                              "status": "Failure", "reason": reason, "message": message,
                              "code": code})  # fmt: skip

        def _from_front_proxy(self) -> bool:
            cert = self.connection.getpeercert()
            subject = dict(x[0] for x in (cert or {}).get("subject", ()))
            return subject.get("commonName") == FRONT_PROXY_USER and bool(
                self.headers.get("X-Remote-User")
            )

        def do_GET(self):  # noqa: N802 (http.server's name)
            if not self._from_front_proxy():
                with adapter.lock:
                    adapter.refused += 1
                return self._status(403, "Forbidden", "only the API server's front proxy may call")
            url = urllib.parse.urlsplit(self.path)
            params = urllib.parse.parse_qs(url.query)
            if url.path in (f"/apis/{GROUP}/{VERSION}", f"/apis/{GROUP}/{VERSION}/"):
                return self._send(200, adapter.discovery())
            m = _PATH.match(url.path)
            if not m:
                return self._status(404, "NotFound", f"{url.path} not served by the test adapter")
            namespace, name, metric = (urllib.parse.unquote(g) for g in m.groups())
            if metric not in adapter.rules:
                return self._status(404, "NotFound", f"metric {metric} not in the chart's rules")
            if params.get("metricLabelSelector", [""])[0]:
                return self._status(400, "BadRequest", "metricLabelSelector is not supported")
            try:
                body = adapter.metric_values(
                    namespace, name, metric, params.get("labelSelector", [""])[0]
                )
            except Exception as e:  # Prometheus or API errors: the HPA sees a failed call
                return self._status(500, "InternalError", f"{type(e).__name__}: {e}")
            return self._send(200, body)

    return Handler
