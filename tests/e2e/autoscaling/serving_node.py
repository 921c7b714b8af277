"""A fake GPU node whose pods really serve.

The harness's `FakeGpuNode` reports pods Running without running anything. This kubelet runs
the pod's server container as a local process:

- each pod gets a loopback address of its own from 127.0.1.0/24 as its pod IP (Linux routes
  all of 127.0.0.0/8 to `lo`, so no network setup and no root are needed);
- the container's command must be the server (`sluice-server` or `python -m sluice_server`);
  it runs as `python -m sluice_server` with the container's args, `--host`/`--port` replaced
  by the pod IP and the container port 8000, and the container's env (absolute paths moved
  under the pod's scratch folder, as its emptyDir volumes would be);
- Ready (pod condition and container status) follows GET /ready, polled every 0.5 s;
- deleting the pod stops the process (SIGTERM to its process group by PID, SIGKILL after a
  few seconds), then the pod object is removed, as a kubelet does after the grace period.

Kubernetes refuses loopback addresses in EndpointSlices (ValidateEndpointIP), so the
Service's slices stay empty here; clients resolve the Service to its ready pods themselves
(loadgen.py), which is what kube-proxy does with the slices.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException
from testkit.process import ManagedProcess

from ..harness.fake_node import FakeGpuNode, _now, _rfc3339

POD_NETWORK = ipaddress.ip_network("127.0.1.0/24")
SERVER_PORT = 8000
STOP_TIMEOUT = 5.0  # the server drains streams on SIGTERM; the tests do not wait for that


class PodNotRunnable(Exception):
    """The pod's container is not the Sluice server: this kubelet cannot run it."""


def server_argv(container: client.V1Container, ip: str, port: int = SERVER_PORT) -> list[str]:
    """`python -m sluice_server` with the container's args, listening on ip:port."""
    command = list(container.command or [])
    if command == ["sluice-server"]:
        pass
    elif len(command) >= 3 and command[1:3] == ["-m", "sluice_server"]:
        pass
    else:
        raise PodNotRunnable(f"container {container.name}: command {command} is not the server")
    args = list(container.args or [])
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--host", "--port"):
            i += 2
            continue
        if a.startswith(("--host=", "--port=")):
            i += 1
            continue
        if a == "--":  # engine passthrough: keep as is, after our flags
            break
        out.append(a)
        i += 1
    return [
        sys.executable,
        "-m",
        "sluice_server",
        *out,
        "--host",
        ip,
        "--port",
        str(port),
        *args[i:],
    ]


def server_env(container: client.V1Container, scratch: Path) -> dict[str, str]:
    """The container's literal env; absolute paths land under the pod's scratch folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    for e in container.env or []:
        if e.value is None:  # valueFrom (secrets, fields): not needed by the simulator
            continue
        value = e.value
        if value.startswith("/"):
            value = str(scratch / value.lstrip("/"))
            Path(value).mkdir(parents=True, exist_ok=True)
        env[e.name] = value
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class RunningPod:
    namespace: str
    name: str
    uid: str
    ip: str
    process: ManagedProcess
    ready: bool = False
    stopping: bool = False
    restarts: int = 0
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    containers: list[str] = field(default_factory=list)
    image: str = ""


class ServingNode(FakeGpuNode):
    """`FakeGpuNode` whose pods run the server; `log_dir` gets one log per pod."""

    def __init__(self, api: client.ApiClient, name: str, log_dir: Path, **kwargs) -> None:
        super().__init__(api, name, **kwargs)
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pods: dict[str, RunningPod] = {}
        self._free_ips = [str(ip) for ip in POD_NETWORK.hosts()][1:]  # 127.0.1.1 stays unused
        self.started: list[tuple[str, str]] = []  # (pod name, ip), in start order

    def start(self) -> ServingNode:
        super().start()
        t = threading.Thread(
            target=self._readiness_loop, name=f"{self.name}-readiness", daemon=True
        )
        t.start()
        self._threads.append(t)
        return self

    def stop(self, delete: bool = True) -> None:
        super().stop(delete)
        with self._lock:
            pods = list(self._pods.values())
            self._pods.clear()
        for p in pods:
            p.process.stop(timeout=STOP_TIMEOUT)

    def running(self) -> list[RunningPod]:
        with self._lock:
            return list(self._pods.values())

    def pids(self) -> list[int]:
        return [p.process.pid for p in self.running() if p.process.pid]

    # --- pods -------------------------------------------------------------------------
    def _sync_pod(self, pod: client.V1Pod) -> None:
        meta = pod.metadata
        try:
            if meta.deletion_timestamp is not None:
                self._delete(pod)
                return
            with self._lock:
                known = meta.uid in self._pods
            if not known:
                self._run(pod)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def _run(self, pod: client.V1Pod) -> None:
        meta = pod.metadata
        container = pod.spec.containers[0]
        ip = self._take_ip()
        scratch = self.log_dir / f"{meta.namespace}.{meta.name}"
        try:
            argv = server_argv(container, ip)
        except PodNotRunnable as e:
            self.errors.append(str(e))
            with self._lock:
                self._free_ips.append(ip)
            return
        env = server_env(container, scratch)
        process = ManagedProcess(f"{meta.namespace}.{meta.name}", argv, self.log_dir, env).start()
        running = RunningPod(meta.namespace, meta.name, meta.uid, ip, process,
                             containers=[c.name for c in pod.spec.containers],
                             image=container.image, argv=argv, env=env)  # fmt: skip
        with self._lock:
            self._pods[meta.uid] = running
            self.started.append((meta.name, ip))
        self._patch_status(running)

    def _take_ip(self) -> str:
        """The next free pod IP whose port 8000 nobody holds (a server left over from an
        interrupted run would otherwise answer for the new pod)."""
        with self._lock:
            for _ in range(len(self._free_ips)):
                ip = self._free_ips.pop(0)
                with socket.socket() as s:
                    try:
                        s.bind((ip, SERVER_PORT))
                        return ip
                    except OSError:
                        self.errors.append(f"{ip}:{SERVER_PORT} is taken by another process")
                        self._free_ips.append(ip)
        raise RuntimeError(f"no free pod IP in {POD_NETWORK}")

    def _delete(self, pod: client.V1Pod) -> None:
        meta = pod.metadata
        with self._lock:
            running = self._pods.get(meta.uid)
            if running is not None:
                if running.stopping:
                    return
                running.stopping = True
        if running is None:
            self.core.delete_namespaced_pod(meta.name, meta.namespace, grace_period_seconds=0)
            return
        # Stopping takes seconds: not on the watch thread.
        threading.Thread(target=self._stop_pod, args=(running,), daemon=True,
                         name=f"stop-{meta.name}").start()  # fmt: skip

    def _stop_pod(self, running: RunningPod) -> None:
        running.process.stop(timeout=STOP_TIMEOUT)
        with self._lock:
            self._pods.pop(running.uid, None)
            self._free_ips.append(running.ip)
        try:
            self.core.delete_namespaced_pod(running.name, running.namespace, grace_period_seconds=0)
        except ApiException as e:
            if e.status != 404:
                self.errors.append(f"delete {running.name}: {e}")

    # --- readiness --------------------------------------------------------------------
    def _readiness_loop(self) -> None:
        while not self._stop.wait(0.5):
            for running in self.running():
                if running.stopping:
                    continue
                if not running.process.alive() and not running.stopping:
                    # restartPolicy Always: start the container again, count the restart
                    self.errors.append(
                        f"{running.name}: server exited, restarting\n{running.process.tail(5)}"
                    )
                    running.restarts += 1
                    running.process = ManagedProcess(running.process.name, running.argv,
                                                     self.log_dir, running.env).start()  # fmt: skip
                ready = running.process.alive() and _probe(
                    f"http://{running.ip}:{SERVER_PORT}/ready"
                )
                if ready != running.ready:
                    running.ready = ready
                    try:
                        self._patch_status(running)
                    except ApiException as e:
                        if e.status not in (404, 409):
                            self.errors.append(f"status {running.name}: {e}")
                    except Exception as e:  # apiserver going away at the end
                        self.errors.append(f"status {running.name}: {e}")

    def _patch_status(self, running: RunningPod) -> None:
        now = _rfc3339(_now())
        ready = "True" if running.ready else "False"
        conditions = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
            {"type": "Ready", "status": ready, "lastTransitionTime": now},
        ]
        containers = [{
            "name": name, "image": running.image, "imageID": f"local://{running.image}",
            "containerID": f"pid://{running.process.pid}", "ready": running.ready,
            "started": True, "restartCount": running.restarts, "state": {"running": {"startedAt": now}},
        } for name in running.containers]  # fmt: skip
        self.core.patch_namespaced_pod_status(running.name, running.namespace, {"status": {
            "phase": "Running", "conditions": conditions, "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}], "podIP": running.ip, "podIPs": [{"ip": running.ip}],
            "startTime": now, "containerStatuses": containers,
        }})  # fmt: skip


def _probe(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except Exception:
        return False
