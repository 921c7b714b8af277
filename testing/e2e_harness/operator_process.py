"""The operator as a subprocess, run the way the Helm chart runs it.

`helm template charts/sluice-operator` is the single source for how the operator runs:
its ServiceAccount, ClusterRole/Role and bindings are applied to the cluster as rendered,
the operator authenticates with a token of that ServiceAccount (so a verb missing from
the chart's RBAC fails the tests), and its command, arguments and ConfigMap environment
are taken from the rendered Deployment.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from kubernetes import client, utils
from kubernetes.client.rest import ApiException
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess
from testkit.repo import ROOT, find_tool

from .control_plane import ControlPlane

RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def find_helm() -> str | None:
    return find_tool("helm")


def find_kubectl() -> str | None:
    """K8S_ASSETS/kubectl first (matches the apiserver), then .tools/bin, then PATH."""
    return find_tool("kubectl", os.environ.get("K8S_ASSETS", ""))


@dataclass
class RenderedChart:
    objects: list[dict]

    @classmethod
    def render(
        cls,
        namespace: str,
        chart: Path = ROOT / "charts/sluice-operator",
        values: dict[str, str] | None = None,
        release: str = "sluice",
    ) -> RenderedChart:
        helm = find_helm()
        if not helm:
            raise RuntimeError("helm not found (make tools installs it into .tools/bin)")
        argv = [helm, "template", release, str(chart), "--namespace", namespace]
        for k, v in (values or {}).items():
            argv += ["--set", f"{k}={v}"]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        return cls([d for d in yaml.safe_load_all(out) if d])

    def of_kind(self, *kinds: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] in kinds]

    def deployment(self) -> dict:
        """The operator's Deployment (the chart also ships the activator's)."""
        (dep,) = [d for d in self.of_kind("Deployment")
                  if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"]  # fmt: skip
        return dep

    def container(self) -> dict:
        return self.deployment()["spec"]["template"]["spec"]["containers"][0]

    def continuation_key(self) -> bytes | None:
        """The router's master continuation key the chart made (its Secret), or None."""
        for secret in self.of_kind("Secret"):
            if secret["metadata"]["name"].endswith("-continuation-key"):
                data = secret.get("data") or {}
                if "continuation-key" in data:
                    return base64.b64decode(data["continuation-key"])
        return None

    def config_env(self) -> dict[str, str]:
        """The ConfigMap(s) the container reads with envFrom, as environment variables."""
        names = {
            s["configMapRef"]["name"]
            for s in self.container().get("envFrom", [])
            if "configMapRef" in s
        }
        env: dict[str, str] = {}
        for cm in self.of_kind("ConfigMap"):
            if cm["metadata"]["name"] in names:
                env.update(cm.get("data") or {})
        return env

    def service_account(self) -> tuple[str, str]:
        """The operator's (its Deployment's; the router has its own)."""
        name = self.deployment()["spec"]["template"]["spec"]["serviceAccountName"]
        (sa,) = [s for s in self.of_kind("ServiceAccount") if s["metadata"]["name"] == name]
        return sa["metadata"]["namespace"], sa["metadata"]["name"]


def install_operator_identity(
    api: client.ApiClient, cp: ControlPlane, chart: RenderedChart
) -> Path:
    """Apply the chart's RBAC as rendered; return a kubeconfig with its ServiceAccount's token."""
    namespace, sa = chart.service_account()
    core = client.CoreV1Api(api)
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    except ApiException as e:
        if e.status != 409:
            raise
    for obj in chart.of_kind(*RBAC_KINDS):
        utils.create_from_dict(api, obj)
    token = core.create_namespaced_service_account_token(
        sa,
        namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=24 * 3600)
        ),
    ).status.token
    return cp.token_kubeconfig(f"operator-{sa}", f"system:serviceaccount:{namespace}:{sa}", token)


class OperatorProcess:
    """`python -m sluice_operator run ...` with the chart's arguments, on loopback."""

    def __init__(
        self, chart: RenderedChart, kubeconfig: Path, log_dir: Path, name: str = "operator"
    ) -> None:
        container = chart.container()
        self.name = name
        self.health_port = free_port()
        self.metrics_port: int | None = None
        argv = [sys.executable if a == "python" else a for a in container["command"]]
        for arg in container.get("args", []):
            if arg.startswith("--liveness="):  # the pod listens on 0.0.0.0; tests stay on loopback
                arg = f"--liveness=http://127.0.0.1:{self.health_port}/healthz"
            if arg.startswith("--continuation-key-file="):  # the chart's Secret, as a file
                key = chart.continuation_key()
                if key is None:
                    continue
                path = Path(log_dir) / f"{name}-continuation-key"
                path.write_bytes(key + b"\n")
                arg = f"--continuation-key-file={path}"
            if arg.startswith("--metrics-port="):  # likewise, and one port per process
                self.metrics_port = free_port()
                argv.append("--metrics-host=127.0.0.1")
                arg = f"--metrics-port={self.metrics_port}"
            argv.append(arg)
        namespace, _ = chart.service_account()
        env = {
            **os.environ,
            **chart.config_env(),
            # What the Deployment's downward API gives the pod: the replica's identity (its
            # user agent and Lease holder) and the namespace of its Lease.
            "POD_NAME": name,
            "POD_NAMESPACE": namespace,
            "KUBECONFIG": str(kubeconfig),
            "SLUICE_OPERATOR_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never fall back to an in-cluster config
        self.argv = argv
        self.env = env
        self.log_dir = log_dir
        self.process: ManagedProcess | None = None
        self.starts = 0

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        self.starts += 1
        self.process = ManagedProcess(
            f"{self.name}-{self.starts}", self.argv, self.log_dir, self.env
        ).start()
        wait_http(f"http://127.0.0.1:{self.health_port}/healthz", timeout=timeout,
                  process=self.process, what="operator")  # fmt: skip
        return self

    def stop(self) -> None:
        if self.process:
            self.process.stop(timeout=15)

    def restart(self) -> OperatorProcess:
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.name}-*.log"))
        )
