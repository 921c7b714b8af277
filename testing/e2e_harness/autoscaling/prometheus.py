"""Debian's `prometheus` on loopback, finding the model servers the way a cluster's does.

Service discovery is `kubernetes_sd_configs` with the pod role against the test API server
(its own client certificate; RBAC lets it list and watch pods) when the binary has it;
Debian's build does not, and then `http_sd_configs` asks pod_sd.py, which yields the same
targets and `__meta_kubernetes_pod_*` labels from the same API server. The relabelling is the
common `kubernetes-pods` job (prometheus community chart): keep pods annotated
`prometheus.io/scrape: "true"`, scrape `prometheus.io/port` and `prometheus.io/path` (the
annotations the operator puts on its pods, docs/design.md), and label every series with
`namespace` and `pod`, which the chart's adapter rule and recording rules rely on.
Scrape and rule evaluation every 2 s so the test's windows stay short. The chart's
recording/alerting rules are loaded too, so a rule the real Prometheus rejects fails here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from kubernetes import client
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess
from testkit.repo import ROOT

RULES_FILE = ROOT / "charts/sluice-operator/files/prometheus-rules.yaml"
SCRAPE_INTERVAL = "2s"
USER = "e2e-prometheus"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def has_kubernetes_sd(workdir: Path) -> bool:
    """Whether this prometheus build knows `kubernetes_sd_configs` (Debian's does not)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return False
    probe = workdir / "probe-kubernetes-sd.yml"
    probe.write_text(yaml.safe_dump({"scrape_configs": [{
        "job_name": "probe", "kubernetes_sd_configs": [{"role": "pod"}]}]}))  # fmt: skip
    return subprocess.run([promtool, "check", "config", str(probe)], capture_output=True,
                          timeout=30).returncode == 0  # fmt: skip


def kubernetes_sd(api_server: str, ca: Path, cert: Path, key: Path) -> dict:
    return {"kubernetes_sd_configs": [{
        "role": "pod",
        "api_server": api_server,
        "tls_config": {"ca_file": str(ca), "cert_file": str(cert), "key_file": str(key)},
    }]}  # fmt: skip


def http_sd(url: str) -> dict:
    return {"http_sd_configs": [{"url": url, "refresh_interval": SCRAPE_INTERVAL}]}


def scrape_config(discovery: dict) -> dict:
    """The `kubernetes-pods` job over `discovery` (kubernetes_sd() or http_sd())."""
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": "1s",
                   "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [{
            "job_name": "kubernetes-pods",
            **discovery,
            "relabel_configs": [
                {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
                 "action": "keep", "regex": "true"},
                {"source_labels": ["__meta_kubernetes_pod_phase"],
                 "action": "drop", "regex": "Pending|Succeeded|Failed"},
                {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
                 "action": "replace", "target_label": "__metrics_path__", "regex": "(.+)"},
                {"source_labels": ["__meta_kubernetes_pod_ip",
                                   "__meta_kubernetes_pod_annotation_prometheus_io_port"],
                 "action": "replace", "regex": r"(.+);(\d+)", "replacement": "$1:$2",
                 "target_label": "__address__"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        }],
    }  # fmt: skip


def grant_pod_discovery(admin: client.ApiClient, user: str = USER) -> None:
    """What the prometheus chart's ClusterRole gives it for the pod role: list/watch pods."""
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_cluster_role(client.V1ClusterRole(
        metadata=client.V1ObjectMeta(name=user),
        rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list", "watch"])],
    ))  # fmt: skip
    rbac.create_cluster_role_binding(client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=user),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=user),
        subjects=[client.RbacV1Subject(kind="User", name=user, api_group="rbac.authorization.k8s.io")],
    ))  # fmt: skip


class Prometheus:
    def __init__(self, workdir: Path, log_dir: Path, config: dict) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus not found (Debian: apt-get install prometheus)")
        self.process = ManagedProcess("prometheus", [
            binary,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ], log_dir)  # fmt: skip

    def start(self, timeout: float = 30.0) -> Prometheus:
        self.process.start()
        wait_http(self.url + "/-/ready", timeout=timeout, process=self.process)
        return self

    def stop(self) -> None:
        self.process.stop(timeout=10)

    def _get(self, path: str, **params) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query: the result vector as Prometheus returns it."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] != "vector":
            raise RuntimeError(f"expected a vector from {expr!r}, got {data['resultType']}")
        return data["result"]

    def targets(self) -> list[dict]:
        return self._get("/api/v1/targets", state="active")["activeTargets"]

    def rule_groups(self) -> list[dict]:
        return self._get("/api/v1/rules")["groups"]
