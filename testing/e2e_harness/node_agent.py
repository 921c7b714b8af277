"""The e2e node agent: a Node object with a kubelet behind it, in one of two modes.

The real scheduler only needs a Node that advertises capacity (GPUs included) and stays
Ready; the node lifecycle controller only needs the Lease in `kube-node-lease` renewed. The
agent does the kubelet's side of that contract in threads:
- heartbeat: renews the Lease and the Ready condition every `heartbeat` seconds;
- pods: watches the pods bound to this node.

Status-only mode (the default, `run_pods=False`): pods are reported Running and Ready with a
pod IP from 10.244.0.0/16 (after `ready_after` seconds), and removed at once when deleted.
No process runs, unless a `runtime` is given (an object with `start(pod)`, called before the
pod is reported Running and returning once its container would be Ready, and `stop(pod)`,
called when the pod is being deleted and returning once the container has exited, before
the pod is removed): `operator_pods.OperatorPods` runs operator pods so. This tests the
control-plane side of the operator, cheaply.

Live mode (`run_pods=True`): every container of a pod bound here runs in a bubblewrap
sandbox built from the pod spec, with probes, restarts and graceful termination as the
kubelet does them (pod_runtime.py, sandbox.py); each pod gets its own loopback address
127.1.x.y as `podIP`/`podIPs` (all of 127.0.0.0/8 reaches `lo`, no setup). Secret,
ConfigMap and projected volumes are refreshed every `config_period` seconds (the kubelet:
about a minute); a projected `serviceAccountToken` is a TokenRequest bound to the pod
(`service_account_token`), and every container finds the API server this agent talks to
in `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT` (`api_server`). A deleted pod's object goes once its containers have stopped: preStop, SIGTERM,
SIGKILL at its grace period. `crash()` is a node loss: the sandboxes are killed, the
heartbeat stops, nothing more is reported, and the control plane must find out itself.

The API server refuses loopback addresses in EndpointSlices, so the Services' slices stay
empty: clients resolve a Service to its Ready pods with `endpoints.ready_endpoints`.
"""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import random
import socket
import threading
import time
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from .pod_runtime import PodRuntime

log = logging.getLogger(__name__)
_pod_ips = itertools.count(2)  # unique pod IPs across all status-only nodes
# And across all live ones (127.1.x.y), never reused. Each run starts at a random /24 of
# 127.1.0.0/16: the port check in `_take_ip` sees only servers already listening, and a real
# engine binds its port minutes after its address was chosen, so two runs on one machine
# that counted from the same start handed the same address to two pods.
_live_ips = itertools.count(250 * random.randrange(200) + 2)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _rfc3339(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class ContainerRuntime(Protocol):
    """What runs a status-only node's pods (`runtime`; the module docstring says when each
    is called): `operator_pods.OperatorPods`."""

    def start(self, pod: client.V1Pod) -> None: ...
    def stop(self, pod: client.V1Pod) -> None: ...


class NodeAgent:
    def __init__(
        self,
        api: client.ApiClient,
        name: str,
        gpus: int = 8,
        gpu_resource: str = "nvidia.com/gpu",
        cpu: str = "128",
        memory: str = "2Ti",
        labels: dict[str, str] | None = None,
        heartbeat: float = 5.0,
        ready_after: float = 0.0,
        taint: dict[str, str] | None = None,
        runtime: ContainerRuntime | None = None,
        run_pods: bool = False,
        workdir: Path | None = None,
        cpus: set[int] | None = None,
        config_period: float = 1.0,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.name = name
        self.capacity = {gpu_resource: str(gpus), "cpu": cpu, "memory": memory, "pods": "250"}
        self.labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.heartbeat = heartbeat
        # Seconds a pod stays Running but not Ready (a model loading), as a real server would.
        self.ready_after = ready_after
        self.taint = taint  # {key, value, effect}: keeps other tests' pods off this node
        self.runtime = runtime
        self.host_ip = "127.0.0.1"
        # Where in-cluster clients reach the API server (KUBERNETES_SERVICE_HOST/PORT): the
        # address this agent itself talks to (the pods share the host's network).
        url = urlsplit(api.configuration.host)
        self.api_server: tuple[str, int] | None = (
            (url.hostname, url.port or 443) if url.hostname else None
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []
        # Live mode: pods (by uid), where their logs, volumes and claims live, CPU pinning.
        self.run_pods = run_pods
        if run_pods and workdir is None:
            raise ValueError("run_pods needs a workdir (pod logs, volumes, claims)")
        self.workdir = Path(workdir) if workdir else None
        self.log_dir = self.workdir / "logs" if self.workdir else Path()
        self.cpus = cpus
        self.config_period = config_period
        self.pods: dict[str, PodRuntime] = {}
        self.exits: list[dict] = []  # every container exit: pod, container, code, why, time
        self.started: list[tuple[str, str]] = []  # (pod name, pod IP), in start order
        self._pods_lock = threading.Lock()

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> NodeAgent:
        if self.workdir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        spec = client.V1NodeSpec(taints=[client.V1Taint(**self.taint)]) if self.taint else None
        self.core.create_node(
            client.V1Node(
                metadata=client.V1ObjectMeta(name=self.name, labels=self.labels), spec=spec
            )
        )
        self._report_status()
        self._renew_lease()
        loops = [self._heartbeat_loop, self._pod_loop]
        if self.run_pods:
            loops.append(self._config_loop)
        for target in loops:
            t = threading.Thread(target=target, name=f"{self.name}-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, delete: bool = True) -> None:
        """Stop the kubelet's loops; with `delete`, remove the Node and the pods bound to
        it, at once, as the pod garbage collector would 40-60 s later (its quarantine of a
        deleted node plus its period): a namespace deleted after the node's test would
        otherwise wait that long for them."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        running = self.running()
        stoppers = [threading.Thread(target=p.terminate, args=(5.0,), daemon=True) for p in running]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(timeout=30)
        if delete:
            try:
                self.core.delete_node(self.name)
            except ApiException as e:
                if e.status != 404:
                    raise
            bound = self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.name}"
            )
            for pod in bound.items:
                try:
                    self.core.delete_namespaced_pod(
                        pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
                    )
                except ApiException as e:
                    if e.status != 404:
                        raise

    # --- heartbeat --------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                self._renew_lease()
                self._report_status()
            except Exception as e:  # keep beating; the test sees `errors` if it matters
                self.errors.append(f"heartbeat: {e}")

    def _renew_lease(self) -> None:
        spec = client.V1LeaseSpec(
            holder_identity=self.name, lease_duration_seconds=40, renew_time=_now()
        )
        try:
            self.coordination.patch_namespaced_lease(
                self.name,
                "kube-node-lease",
                {
                    "spec": {
                        "holderIdentity": self.name,
                        "leaseDurationSeconds": 40,
                        "renewTime": _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                    }
                },
            )
        except ApiException as e:
            if e.status != 404:
                raise
            self.coordination.create_namespaced_lease(
                "kube-node-lease",
                client.V1Lease(metadata=client.V1ObjectMeta(name=self.name), spec=spec),
            )

    def _report_status(self) -> None:
        now = _rfc3339(_now())
        self.core.patch_node_status(
            self.name,
            {
                "status": {
                    "capacity": self.capacity,
                    "allocatable": self.capacity,
                    "addresses": [
                        {"type": "InternalIP", "address": self.host_ip},
                        {"type": "Hostname", "address": self.name},
                    ],
                    "conditions": [
                        {
                            "type": t,
                            "status": "False",
                            "reason": f"Kubelet{r}",
                            "message": "fake kubelet",
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                        for t, r in (
                            ("MemoryPressure", "HasSufficientMemory"),
                            ("DiskPressure", "HasNoDiskPressure"),
                            ("PIDPressure", "HasSufficientPID"),
                        )
                    ]
                    + [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "fake kubelet is posting ready status",
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                    ],
                    "nodeInfo": {
                        "kubeletVersion": "v1.36.0-fake",
                        "containerRuntimeVersion": "fake://0",
                        "operatingSystem": "linux",
                        "architecture": "amd64",
                        "kernelVersion": "",
                        "osImage": "fake",
                        "kubeProxyVersion": "",
                        "machineID": "",
                        "systemUUID": "",
                        "bootID": "",
                    },
                }
            },
        )

    # --- pods -------------------------------------------------------------------------
    def _pod_loop(self) -> None:
        selector = f"spec.nodeName={self.name}"
        while not self._stop.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces(field_selector=selector)
                for pod in listing.items:
                    self._sync_pod(pod)
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=2,
                )
                for event in stream:
                    if self._stop.is_set():
                        break
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._sync_pod(event["object"])
            except Exception as e:  # expired resourceVersion, apiserver going away: relist
                if not self._stop.is_set():
                    self.errors.append(f"pods: {e}")
                    self._stop.wait(0.5)

    def _sync_pod(self, pod: client.V1Pod) -> None:
        if self.run_pods:
            self._sync_live(pod)
            return
        meta = pod.metadata
        try:
            if meta.deletion_timestamp is not None:
                if self.runtime is not None:
                    self.runtime.stop(pod)
                # The kubelet's last word: the containers are gone, remove the object.
                self.core.delete_namespaced_pod(meta.name, meta.namespace, grace_period_seconds=0)
            elif not (pod.status and pod.status.phase == "Running" and pod.status.pod_ip):
                if self.runtime is not None:
                    self.runtime.start(pod)
                ready = self.ready_after <= 0
                status = self._running(pod, ready=ready)
                self.core.patch_namespaced_pod_status(meta.name, meta.namespace, status)
                if not ready:
                    timer = threading.Timer(self.ready_after, self._mark_ready, (pod, status))
                    timer.daemon = True
                    timer.start()
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def _mark_ready(self, pod: client.V1Pod, status: dict) -> None:
        now = _rfc3339(_now())
        for c in status["status"]["conditions"]:
            if c["type"] in ("ContainersReady", "Ready"):
                c.update(status="True", lastTransitionTime=now)
        for c in status["status"]["containerStatuses"]:
            c["ready"] = True
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, status)
        except ApiException as e:
            if e.status not in (404, 409):
                self.errors.append(f"ready {pod.metadata.name}: {e}")

    def _running(self, pod: client.V1Pod, ready: bool = True) -> dict:
        now = _rfc3339(_now())
        n = next(_pod_ips)
        ip = f"10.244.{n // 250}.{n % 250 + 1}"
        conditions = [
            {
                "type": t,
                "status": "True" if ready or t not in ("ContainersReady", "Ready") else "False",
                "lastTransitionTime": now,
            }
            for t in (
                "PodReadyToStartContainers",
                "Initialized",
                "ContainersReady",
                "Ready",
                "PodScheduled",
            )
        ]
        containers = [
            {
                "name": c.name,
                "image": c.image,
                "imageID": f"fake://{c.image}",
                "containerID": f"fake://{pod.metadata.uid}/{c.name}",
                "ready": ready,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod.spec.containers
        ]
        return {
            "status": {
                "phase": "Running",
                "conditions": conditions,
                "hostIP": self.host_ip,
                "hostIPs": [{"ip": self.host_ip}],
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": now,
                "containerStatuses": containers,
            }
        }

    # --- live mode ----------------------------------------------------------------------
    def running(self) -> list[PodRuntime]:
        with self._pods_lock:
            return list(self.pods.values())

    def pod(self, name: str, namespace: str | None = None) -> PodRuntime:
        """The live pod of that name (the newest, should several have had it)."""
        found = [p for p in self.running()
                 if p.name == name and namespace in (None, p.namespace)]  # fmt: skip
        if not found:
            raise KeyError(f"no pod {name} on {self.name}")
        return max(found, key=lambda p: p.start_time)

    def pids(self) -> list[int]:
        return [pid for p in self.running() for pid in p.pids()]

    def crash(self) -> None:
        """The node is lost: its sandboxes die, its heartbeat and its reports stop."""
        self._stop.set()
        for p in self.running():
            p.kill_now()
        for t in self._threads:
            t.join(timeout=10)

    def _sync_live(self, pod: client.V1Pod) -> None:
        meta = pod.metadata
        with self._pods_lock:
            runtime = self.pods.get(meta.uid)
        if meta.deletion_timestamp is not None:
            if runtime is None:
                self._remove(meta.name, meta.namespace, meta.uid)
            elif not runtime.terminating.is_set():
                grace = meta.deletion_grace_period_seconds
                grace = 30.0 if grace is None else float(grace)
                threading.Thread(target=self._terminate, args=(runtime, grace), daemon=True,
                                 name=f"terminate-{meta.name}").start()  # fmt: skip
            return
        if runtime is not None or (pod.status and pod.status.phase in ("Succeeded", "Failed")):
            return
        body = self.core.api_client.sanitize_for_serialization(pod)
        runtime = PodRuntime(body, self._take_ip(body), self, self._live_workdir() / "pods")
        with self._pods_lock:
            self.pods[meta.uid] = runtime
            self.started.append((meta.name, runtime.ip))
        runtime.start()

    def _terminate(self, runtime: PodRuntime, grace: float) -> None:
        runtime.terminate(grace)
        self._remove(runtime.name, runtime.namespace, runtime.uid)
        with self._pods_lock:
            self.pods.pop(runtime.uid, None)

    def _remove(self, name: str, namespace: str, uid: str) -> None:
        """The kubelet's last word on a deleted pod: its containers are gone."""
        try:
            self.core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0,
                                            preconditions=client.V1Preconditions(uid=uid)),
            )  # fmt: skip
        except ApiException as e:
            if e.status not in (404, 409):
                self.errors.append(f"remove {name}: {e}")

    def _take_ip(self, pod: dict) -> str:
        """A fresh 127.1.x.y whose container ports nobody holds (a server left over from an
        interrupted run would otherwise answer for the new pod)."""
        ports = [
            p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []
        ]
        for _ in range(100):
            n = next(_live_ips)
            ip = f"127.1.{n // 250}.{n % 250 + 1}"
            try:
                for port in ports:
                    with socket.socket() as s:
                        s.bind((ip, port))
                return ip
            except OSError:
                self.errors.append(f"{ip}: a container port is taken by another process")
        raise RuntimeError("no free pod address in 127.1.0.0/16")

    def _config_loop(self) -> None:
        while not self._stop.wait(self.config_period):
            for p in self.running():
                try:
                    p.refresh_projections()
                except Exception as e:
                    self.errors.append(f"volumes of {p.name}: {e}")

    # --- what a pod asks of its node (pod_runtime.Host) --------------------------------
    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
        from .sandbox import object_data

        read = self.core.read_namespaced_secret if kind == "secret" else (
            self.core.read_namespaced_config_map)  # fmt: skip
        try:
            obj = read(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return object_data(kind, self.core.api_client.sanitize_for_serialization(obj))

    def service_account_token(self, pod: dict, audience: str | None,
                              seconds: int) -> tuple[str, float]:  # fmt: skip
        """A token of the pod's ServiceAccount bound to the pod (TokenRequest, as the
        kubelet asks for a projected `serviceAccountToken`): (token, expiry in epoch s).
        The API server authenticates it as `system:serviceaccount:<ns>:<sa>` with the
        pod's name and uid in its extra fields, and refuses it once the pod is gone."""
        meta = pod["metadata"]
        sa = pod["spec"].get("serviceAccountName") or "default"
        got = self.core.create_namespaced_service_account_token(
            sa,
            meta["namespace"],
            client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(
                    audiences=[audience] if audience else [],
                    expiration_seconds=seconds,
                    bound_object_ref=client.V1BoundObjectReference(
                        api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]
                    ),
                )
            ),
        )
        return got.status.token, got.status.expiration_timestamp.timestamp()

    def _live_workdir(self) -> Path:
        """Where live mode keeps pods and claims (`run_pods=True` needs a workdir)."""
        if self.workdir is None:
            raise RuntimeError(f"node {self.name}: pods run only with run_pods=True and a workdir")
        return self.workdir

    def pvc_dir(self, namespace: str, claim: str) -> Path:
        """One folder per claim: what a test puts there, the pod sees at its mount."""
        path = self._live_workdir() / "claims" / namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def patch_status(self, pod: dict, status: dict) -> None:
        meta = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], status)
        except ApiException as e:
            if e.status not in (404, 409):
                self.errors.append(f"status {meta['name']}: {e}")
        except Exception as e:  # the API server going away at the end of a run
            self.errors.append(f"status {meta['name']}: {e}")

    def record_exit(self, pod: dict, container: str, code: int, why: str) -> None:
        meta = pod["metadata"]
        self.exits.append({"pod": meta["name"], "namespace": meta["namespace"],
                           "container": container, "code": code, "why": why,
                           "time": time.time()})  # fmt: skip
