"""Operator pods that really run: the container runtime behind a fake node for the chart's pods.

`helm install`/`upgrade` of `charts/sluice-operator` makes a Deployment; the controller
manager makes its pods and the scheduler binds them to a `NodeAgent` whose `runtime` is an
`OperatorPods`. For each pod it does what a kubelet would for the container: it runs the
pod's own command and arguments (`python -m sluice_operator run ...`) with the pod's
environment (values, downward-API fieldRefs, envFrom ConfigMaps) and a token of the pod's
ServiceAccount bound to the pod (so the audit log names the pod in
`user.extra["authentication.kubernetes.io/pod-name"]`, whatever the code sends as its user
agent), from the code that the pod's image tag names (`code`: tag -> a source tree with
`operator/`), through a `TcpProxy` of its own (`cut()` it to stop answering that pod). The
pod turns Ready once the operator's health endpoint answers; when the pod is deleted the
process gets SIGTERM and the pod's grace period, and only then is the pod removed. Every
container's start and end are kept (`history`), to show which versions ran side by side.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

from .control_plane import ControlPlane
from .tcp_proxy import TcpProxy

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"


@dataclass
class Container:
    pod: str
    uid: str
    tag: str
    process: ManagedProcess
    proxy: TcpProxy
    started: float  # time.time() when the process was started
    ready: float | None = None
    stopped: float | None = None
    killed: bool = False

    def log_text(self) -> str:
        return self.process.log_path.read_text(errors="replace")


class OperatorPods:
    def __init__(
        self, cp: ControlPlane, api: client.ApiClient, code: dict[str, Path], log_dir: Path
    ) -> None:
        self.cp, self.code, self.log_dir = cp, code, log_dir
        self.core = client.CoreV1Api(api)
        self._lock = threading.Lock()
        self.containers: dict[str, Container] = {}  # pod uid -> its running container
        self.history: list[Container] = []

    # --- what NodeAgent calls -----------------------------------------------------------
    def start(self, pod: client.V1Pod) -> None:
        meta = pod.metadata
        if meta.uid in self.containers:
            return
        (spec,) = pod.spec.containers
        tag = spec.image.rsplit(":", 1)[1]
        root = self.code[tag]
        health = free_port()
        argv = [sys.executable if a == "python" else a for a in spec.command]
        for arg in spec.args or []:
            if arg.startswith("--liveness="):  # the pod listens on 0.0.0.0; tests stay on loopback
                arg = f"--liveness=http://127.0.0.1:{health}/healthz"
            if arg.startswith("--metrics-port="):  # likewise, and one port per pod
                argv.append("--metrics-host=127.0.0.1")
                arg = f"--metrics-port={free_port()}"
            argv.append(arg)
        proxy = TcpProxy(self.cp.port).start()
        env = {
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHONPATH": str(root / "operator"),
            "KUBECONFIG": str(self._kubeconfig(pod, proxy)),
            **self._env(spec, pod),
        }
        process = ManagedProcess(meta.name, argv, self.log_dir, env)
        container = Container(meta.name, meta.uid, tag, process, proxy, time.time())
        with self._lock:
            self.containers[meta.uid] = container
            self.history.append(container)
        process.start()
        wait_http(f"http://127.0.0.1:{health}/healthz", timeout=90, process=process,
                  what=f"operator pod {meta.name} ({tag})")  # fmt: skip
        container.ready = time.time()

    def stop(self, pod: client.V1Pod) -> None:
        with self._lock:
            container = self.containers.pop(pod.metadata.uid, None)
        if container is None:
            return
        grace = pod.spec.termination_grace_period_seconds or 30
        container.process.stop(timeout=grace)
        container.stopped = container.stopped or time.time()
        container.proxy.stop()

    # --- what tests call --------------------------------------------------------------
    def running(self) -> list[Container]:
        with self._lock:
            return [c for c in self.containers.values() if not c.killed]

    def by_pod(self, name: str) -> Container:
        (container,) = [c for c in self.history if c.pod == name]
        return container

    def kill(self, name: str) -> float:
        """SIGKILL the pod's container (no restart, no shutdown handler); returns when."""
        container = self.by_pod(name)
        proc = container.process.started()
        at = time.time()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        container.killed, container.stopped = True, at
        return at

    def close(self) -> None:
        with self._lock:
            containers, self.containers = list(self.containers.values()), {}
        for c in containers:
            c.process.stop(timeout=10)
            c.stopped = c.stopped or time.time()
            c.proxy.stop()

    # --- the pod's environment ----------------------------------------------------------
    def _kubeconfig(self, pod: client.V1Pod, proxy: TcpProxy) -> Path:
        meta, sa = pod.metadata, pod.spec.service_account_name
        token = self.core.create_namespaced_service_account_token(
            sa,
            meta.namespace,
            client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(
                    audiences=[],
                    expiration_seconds=3600,
                    bound_object_ref=client.V1BoundObjectReference(
                        api_version="v1", kind="Pod", name=meta.name, uid=meta.uid
                    ),
                )
            ),
        ).status.token
        user = f"system:serviceaccount:{meta.namespace}:{sa}"
        path = self.cp.token_kubeconfig(f"pod-{meta.name}", user, token)
        text = path.read_text().replace(self.cp.url, proxy.url)
        path.write_text(text)
        return path

    def _env(self, spec: client.V1Container, pod: client.V1Pod) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in spec.env_from or []:
            if source.config_map_ref is not None:
                cm = self.core.read_namespaced_config_map(
                    source.config_map_ref.name, pod.metadata.namespace
                )
                env.update(cm.data or {})
        fields = {
            "metadata.name": pod.metadata.name,
            "metadata.namespace": pod.metadata.namespace,
            "spec.nodeName": pod.spec.node_name or "",
        }
        for var in spec.env or []:
            if var.value is not None:
                env[var.name] = var.value
            elif var.value_from is not None and var.value_from.field_ref is not None:
                env[var.name] = fields[var.value_from.field_ref.field_path]
        return env


def writer_of(event: dict) -> str | None:
    """Which pod made an audited call: its bound token's pod name."""
    extra = (event.get("user") or {}).get("extra") or {}
    names = extra.get(POD_NAME_EXTRA) or []
    return names[0] if names else None
