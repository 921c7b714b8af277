"""A Service -> its Ready pods' addresses, the way kube-proxy and ingress controllers read
EndpointSlices.

The API server refuses loopback addresses in EndpointSlices (ValidateEndpointIP), and the
node agent's pods live on 127.1.x.y, so the slices stay empty here. Everything that routes
to pods in the e2e suite (the ingress, the load generators) asks this one helper instead,
which applies the EndpointSlice controller's rules: the Service's selector, pods with an IP,
`Ready=True`, not terminating (a terminating pod is `ready: false, serving: ...` in a slice,
and kube-proxy and ingress-nginx send it nothing new), and the Service port's `targetPort`
resolved per pod (a name is looked up in that pod's container ports).

An `ExternalName` Service whose name is another Service's cluster name
(`<service>.<namespace>.svc.cluster.local`) resolves to that Service's Ready endpoints on
the same port number: what the cluster DNS (a CNAME to the Service) and kube-proxy (its
port to the pods' target port) give an ingress controller that proxies to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes import client

CLUSTER_DOMAIN = ".svc.cluster.local"


@dataclass(frozen=True, order=True)
class Endpoint:
    ip: str
    port: int
    pod: str

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"


def _is_ready(pod: client.V1Pod) -> bool:
    if pod.metadata.deletion_timestamp is not None or not (pod.status and pod.status.pod_ip):
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _target_port(pod: client.V1Pod, target: int | str) -> int | None:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for c in pod.spec.containers:
        for p in c.ports or []:
            if p.name == target:
                return p.container_port
    return None


def service_port(svc: client.V1Service, port: int | str | None) -> client.V1ServicePort:
    """The Service's port by number or name (the only one when `port` is None)."""
    ports = svc.spec.ports or []
    for p in ports:
        if port is None or port in (p.port, p.name):
            return p
    raise LookupError(f"service {svc.metadata.name} has no port {port}")


def ready_endpoints(
    core: client.CoreV1Api, namespace: str, service: str, port: int | str | None = None
) -> list[Endpoint]:
    """Ready endpoints of `service`'s `port` (number or name), sorted; [] when the Service
    is missing or selects nothing."""
    try:
        svc = core.read_namespaced_service(service, namespace)
    except client.ApiException as e:
        if e.status == 404:
            return []
        raise
    if svc.spec.type == "ExternalName":
        name, _, ns = (svc.spec.external_name or "").removesuffix(CLUSTER_DOMAIN).partition(".")
        if not (svc.spec.external_name or "").endswith(CLUSTER_DOMAIN) or not ns or "." in ns:
            return []  # a name outside the cluster: nothing here answers it
        number = service_port(svc, port).port
        return ready_endpoints(core, ns, name, number)
    if not svc.spec.selector:
        return []
    sp = service_port(svc, port)
    target = sp.target_port if sp.target_port is not None else sp.port
    selector = ",".join(f"{k}={v}" for k, v in sorted(svc.spec.selector.items()))
    out = []
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        if not _is_ready(pod):
            continue
        number = _target_port(pod, target)
        if number is not None:
            out.append(Endpoint(pod.status.pod_ip, number, pod.metadata.name))
    return sorted(out)


def ready_pod_ips(core: client.CoreV1Api, namespace: str, service: str) -> list[str]:
    """The Ready pods' IPs behind `service` (any port), sorted."""
    return sorted({e.ip for e in ready_endpoints(core, namespace, service)})
