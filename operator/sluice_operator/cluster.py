"""The few Kubernetes API calls the operator makes, behind one small interface.

Handlers talk to a `Cluster`; production uses `KubeCluster` (the official client, any
kubeconfig or in-cluster config), tests use a fake that counts calls. Every call here is
listed in operator/README.md ("Kubernetes API access"), which the chart's RBAC follows.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .builders.common import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER, PORT
from .election import LeaseConflict, LeaseRecord
from .kinds import POD, STREAMING_MODEL, Kind, plural_of

FIELD_MANAGER = "sluice-operator"


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    """URL of a namespaced collection under /api or /apis; the plural comes from `kinds`."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural_of(api_version, kind)}"


def object_path(manifest: dict[str, Any]) -> str:
    meta = manifest["metadata"]
    collection = collection_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
    return f"{collection}/{meta['name']}"


class Cluster(Protocol):
    def get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None: ...

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]: ...

    def replace_lists(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386) of the manifest's content (`spec`, a ConfigMap's
        `data`): maps merge key by key, every list in it replaces the live one whole
        (entries other managers added go)."""
        ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int
    ) -> dict[str, Any] | None:
        """Set the workload's replicas through its scale subresource (a merge patch of
        `spec.replicas`); returns the Scale as stored."""
        ...

    def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Apply a JSON merge patch (RFC 7386: `null` deletes) to the status subresource;
        returns the StreamingModel as stored."""
        ...


class LiveReads:
    """A pass's reads straight from the API: one GET per child, a LIST for pods.

    The operator reads from memory (`cluster_view.ClusterView`, fed by its watches); this is what a
    pass costs without them: `reconcile.converge` called on its own (one-off passes, tests).
    """

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        return self._cluster.get(kind.api_version, kind.kind, namespace, name)

    def pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        selector = f"{INSTANCE_LABEL}={owner},{MANAGED_BY_LABEL}={MANAGER}"
        return self._cluster.list_pods(namespace, selector)

    def wrote(self, obj: dict[str, Any] | None) -> dict[str, Any] | None:
        return obj

    def deleted(self, kind: Kind, namespace: str, name: str, last: dict[str, Any]) -> None:
        pass

    def applied(self, kind: Kind, namespace: str, owner: str) -> str | None:
        return None  # no memory: a child that is never read is applied on every pass

    def remember_applied(self, kind: Kind, namespace: str, owner: str, digest: str | None) -> None:
        pass


class KubeCluster:
    """`Cluster` over the official Python client's ApiClient (raw paths, JSON in and out)."""

    def __init__(self, api_client: Any | None = None) -> None:
        from kubernetes import client

        self._client = api_client or client.ApiClient()

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        method, url, headers, body, post = self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self._client.call_api(
            method,
            url,
            header_params=headers,
            body=body,
            post_params=post,
            _request_timeout=timeout,
        )
        resp.read()
        if not 200 <= resp.status <= 299:
            text = resp.data.decode(errors="replace") if resp.data else None
            raise ApiException.from_response(http_resp=resp, body=text, data=None)
        return json.loads(resp.data) if resp.data else None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            obj: dict[str, Any] = self._call(
                "GET", f"{collection_path(api_version, kind, namespace)}/{name}"
            )
            return obj
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        path = object_path(manifest)
        # JSON is YAML: the apply-patch content type takes the JSON body as is. force: the
        # operator owns these fields; a hand edit must not block convergence.
        stored: dict[str, Any] = self._call(
            "PATCH",
            path,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=manifest,
            content_type="application/apply-patch+yaml",
        )
        return stored

    def replace_lists(self, manifest: dict[str, Any]) -> dict[str, Any]:
        path = object_path(manifest)
        stored: dict[str, Any] = self._call(
            "PATCH",
            path,
            query=[("fieldManager", FIELD_MANAGER)],
            body={k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata")},
            content_type="application/merge-patch+json",
        )
        return stored

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._call(
                "DELETE",
                f"{collection_path(api_version, kind, namespace)}/{name}",
                body={"propagationPolicy": "Background"},
                content_type="application/json",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        data = self._call(
            "GET",
            collection_path(POD.api_version, POD.kind, namespace),
            query=[("labelSelector", selector)],
        )
        pods: list[dict[str, Any]] = (data or {}).get("items") or []
        return pods

    def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int
    ) -> dict[str, Any] | None:
        """Scale to zero and back (scaletozero.py): the scale subresource, so only
        `spec.replicas` changes and no field manager takes over the workload's spec."""
        path = f"{collection_path(api_version, kind, namespace)}/{name}/scale"
        stored: dict[str, Any] | None = self._call(
            "PATCH",
            path,
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )
        return stored

    def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any] | None:
        """A merge patch of only what changed, nulls for what vanished (`status.status_patch`).

        Why this and not the alternatives: server-side apply on /status would only remove
        fields this manager applied before, not those earlier operator versions wrote with
        merge patches (another managedFields entry), so upgraded clusters would keep stale
        keys; a PUT of the object with its resourceVersion conflicts with kopf's own
        annotation patches and sends the whole object. The diff is taken against the status
        read under the model's lock, and the operator is the only writer of this status, so
        it is exact; were it ever computed from a stale read, the next pass diffs again.
        """
        sm = STREAMING_MODEL
        path = f"{collection_path(sm.api_version, sm.kind, namespace)}/{name}/status"
        stored: dict[str, Any] | None = self._call(
            "PATCH", path, body={"status": patch}, content_type="application/merge-patch+json"
        )
        return stored


class WriteFenced(Exception):
    """This replica may not write now (it is not the leader): the pass stops here."""


class FencedCluster:
    """A `Cluster` whose writes first ask `may_write` (the leader election's fence).

    Reads pass through (a standby may read); a write asked while the fence is closed raises
    `WriteFenced` before any request is sent, so a replica that lost its Lease sends
    nothing more, even from a pass that started while it led.
    """

    def __init__(self, cluster: Cluster, may_write: Callable[[], bool]) -> None:
        self._cluster = cluster
        self.may_write = may_write

    def _check(self, what: str) -> None:
        if not self.may_write():
            raise WriteFenced(f"not the leader: {what} not sent")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._cluster.get(api_version, kind, namespace, name)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self._cluster.list_pods(namespace, selector)

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self._check(f"apply of {manifest.get('kind')}")
        return self._cluster.apply(manifest)

    def replace_lists(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self._check(f"merge patch of {manifest.get('kind')}")
        return self._cluster.replace_lists(manifest)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._check(f"delete of {kind}")
        return self._cluster.delete(api_version, kind, namespace, name)

    def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int
    ) -> dict[str, Any] | None:
        self._check(f"scale of {kind}")
        return self._cluster.scale(api_version, kind, namespace, name, replicas)

    def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any] | None:
        self._check("status patch")
        return self._cluster.patch_status(namespace, name, patch)


def _lease_record(lease: dict[str, Any]) -> LeaseRecord:
    spec = lease.get("spec") or {}
    return LeaseRecord(
        holder=spec.get("holderIdentity") or None,
        duration_seconds=spec.get("leaseDurationSeconds"),
        acquire_time=spec.get("acquireTime"),
        renew_time=spec.get("renewTime"),
        transitions=spec.get("leaseTransitions") or 0,
        resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
    )


class KubeLeases:
    """`election.LeaseStore` for one Lease: GET, POST (create) and PUT (update) only, which
    is what the chart's RBAC grants (`coordination.k8s.io` `leases`). The blocking client
    runs in a worker thread; each request gives up after `timeout` seconds."""

    PATH = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    def __init__(self, cluster: KubeCluster, namespace: str, name: str, timeout: float) -> None:
        self._cluster, self.namespace, self.name, self.timeout = cluster, namespace, name, timeout
        self._collection = self.PATH.format(namespace=namespace)

    def _body(self, record: LeaseRecord) -> dict[str, Any]:
        spec = {
            "holderIdentity": record.holder,
            "leaseDurationSeconds": record.duration_seconds,
            "acquireTime": record.acquire_time,
            "renewTime": record.renew_time,
            "leaseTransitions": record.transitions,
        }
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record.resource_version:
            meta["resourceVersion"] = record.resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {k: v for k, v in spec.items() if v is not None},
        }

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._cluster._call(
                method,
                path,
                body=body,
                content_type="application/json" if body else None,
                timeout=self.timeout,
            )
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(f"Lease {self.namespace}/{self.name} changed first") from None
            raise

    def _get(self) -> LeaseRecord | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return _lease_record(self._send("GET", f"{self._collection}/{self.name}"))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def get(self) -> LeaseRecord | None:
        return await asyncio.to_thread(self._get)

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        body = self._body(record)
        return _lease_record(await asyncio.to_thread(self._send, "POST", self._collection, body))

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        body = self._body(record)
        path = f"{self._collection}/{self.name}"
        return _lease_record(await asyncio.to_thread(self._send, "PUT", path, body))


def pod_metrics_page(pod: Mapping[str, Any], timeout: float = 2.0) -> str | None:
    """A model pod's own /metrics page (GET, no credential: what Prometheus scrapes), or
    None when it cannot be read. The only call the operator makes to a pod
    (adapterstatus.py says why it is the way adapter states reach the status)."""
    import urllib.request

    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with urllib.request.urlopen(f"http://{host}:{PORT}/metrics", timeout=timeout) as r:
            body: bytes = r.read(4 << 20)
            return body.decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def weights_progress(pod: Mapping[str, Any], timeout: float = 2.0) -> dict[str, Any] | None:
    """A running weights download's `GET /progress` (files and bytes done of total), or None
    when it cannot be read (weightsstate.py: how progress reaches the status)."""
    import urllib.request

    from .builders.weights import PROGRESS_PORT

    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with urllib.request.urlopen(
            f"http://{host}:{PROGRESS_PORT}/progress", timeout=timeout
        ) as r:
            data = json.loads(r.read(1 << 16))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
