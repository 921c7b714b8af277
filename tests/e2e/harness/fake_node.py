"""A fake GPU node: a Node object with a fake kubelet behind it.

The real scheduler only needs a Node that advertises capacity and stays Ready; the node
lifecycle controller only needs the Lease in `kube-node-lease` renewed. This class does the
kubelet's side of that contract in two threads:
- heartbeat: renews the Lease and the Ready condition every `heartbeat` seconds;
- pods: watches pods bound to this node, reports them Running and Ready with a pod IP
  (what the Deployment controller and Endpoints need), and removes pods being deleted.
No container runs unless a `runtime` is given (an object with `start(pod)`, called before
the pod is reported Running and returning once its container would be Ready, and
`stop(pod)`, called when the pod is being deleted and returning once the container has
exited, before the pod is removed): `operator_pods.OperatorPods` runs operator pods so.
"""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import threading

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)
_pod_ips = itertools.count(2)  # unique pod IPs across all fake nodes


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _rfc3339(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeGpuNode:
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
        runtime: object | None = None,
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
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> FakeGpuNode:
        spec = client.V1NodeSpec(taints=[client.V1Taint(**self.taint)]) if self.taint else None
        self.core.create_node(
            client.V1Node(
                metadata=client.V1ObjectMeta(name=self.name, labels=self.labels), spec=spec
            )
        )
        self._report_status()
        self._renew_lease()
        for target in (self._heartbeat_loop, self._pod_loop):
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
