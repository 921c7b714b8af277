"""Helpers shared by the operator tests (a plain module: conftest.py names collide across test
dirs). The repository root and Kubernetes versions come from testing/testkit."""

from __future__ import annotations

import copy
import itertools
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf
import yaml
from kubernetes.client.exceptions import ApiException
from sluice_operator.cluster_view import ClusterView, index_key
from sluice_operator.kinds import INDEXED_KINDS
from sluice_operator.wiring import Leadership, Options, Runtime, wire
from testkit.repo import LWS_CRD, ROOT, shared_crd

SAMPLES = sorted((ROOT / "samples").glob("*.yaml"))
INVALID_SAMPLES = sorted((ROOT / "samples" / "invalid").glob("*.yaml"))
# KEDA's ScaledObject is not a built-in kind (kubernetes-validate has no schema for it): a
# minimal strict schema written from KEDA's documented spec stands in.
KEDA_SCHEMA = ROOT / "tests" / "operator" / "schemas" / "keda-scaledobject.schema.json"
# The same for the Prometheus Operator's PodMonitor, written from its API reference.
POD_MONITOR_SCHEMA = ROOT / "tests" / "operator" / "schemas" / "podmonitor.schema.json"
# Gateway API's HTTPRoute likewise: a strict subset written from the Gateway API reference
# (the official CRDs are not in any registry reachable here).
HTTPROUTE_SCHEMA = ROOT / "tests" / "operator" / "schemas" / "gateway-httproute.schema.json"
# The Inference Extension's InferencePool likewise (the official CRD is checked too where
# ../shared/crds holds it: test_operator_routing.py).
INFERENCE_POOL_SCHEMA = ROOT / "tests" / "operator" / "schemas" / "inferencepool.schema.json"


def _unknown_fields(value, schema: dict, at: str = "") -> list[str]:
    """Fields a structural schema does not declare (the API server would prune them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = []
        for key, sub in value.items():
            if props is not None and key in props:
                out += _unknown_fields(sub, props[key], f"{at}.{key}")
            elif isinstance(extra, dict):
                out += _unknown_fields(sub, extra, f"{at}.{key}")
            elif props is not None or extra is not True:
                out.append(f"{at}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            u
            for i, v in enumerate(value)
            for u in _unknown_fields(v, schema["items"], f"{at}[{i}]")
        ]
    return []


def validate_leaderworkerset(manifest: dict, version: str) -> None:
    """Each pod template strictly as a Pod (kubernetes-validate, always); the whole object
    against the official LWS v0.10 CRD (types, enums, no unknown field) where it is here."""
    import kubernetes_validate

    templates = manifest["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, **templates[role]}
        pod["metadata"] = {"name": "p", **templates[role].get("metadata", {})}
        kubernetes_validate.validate(pod, version, strict=True)
    path = shared_crd(LWS_CRD)
    if path is None:
        return
    import jsonschema

    crd = yaml.safe_load(path.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft7Validator(schema).validate(manifest)
    body = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata")}
    assert _unknown_fields(body, schema) == [], _unknown_fields(body, schema)


def validate_manifest(manifest: dict, version: str) -> None:
    """Strict schema validation: kubernetes-validate for built-in kinds, ours for KEDA's
    ScaledObject, Gateway API's HTTPRoute, the Inference Extension's InferencePool and the
    Prometheus Operator's PodMonitor."""
    api_version = manifest.get("apiVersion", "")
    if api_version.startswith("leaderworkerset.x-k8s.io/"):
        validate_leaderworkerset(manifest, version)
        return
    own = {
        "keda.sh/": KEDA_SCHEMA,
        "gateway.networking.k8s.io/": HTTPROUTE_SCHEMA,
        "monitoring.coreos.com/": POD_MONITOR_SCHEMA,
        "inference.networking.k8s.io/": INFERENCE_POOL_SCHEMA,
    }
    for prefix, path in own.items():
        if api_version.startswith(prefix):
            import jsonschema

            schema = json.loads(path.read_text())
            jsonschema.Draft202012Validator(schema).validate(manifest)
            return
    import kubernetes_validate

    kubernetes_validate.validate(manifest, version, strict=True)


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def expectations(path: Path) -> dict[str, str]:
    """`# expect-operator: ...` / `# expect-apiserver: ...` header lines of an invalid sample."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("# expect-"):
            key, _, value = line[2:].partition(":")
            out[key.strip()] = value.strip()
    return out


def body_of(
    path_or_dict, *, uid: str = "uid-1", generation: int = 1, namespace: str = "default"
) -> dict:
    """A StreamingModel as the API server would hand it to the operator."""
    body = load(path_or_dict) if isinstance(path_or_dict, Path) else dict(path_or_dict)
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", namespace)
    meta.update(uid=uid, generation=generation)
    body["metadata"] = meta
    body.setdefault("apiVersion", "serving.sluice.dev/v1alpha1")
    body.setdefault("kind", "StreamingModel")
    return body


def minimal(**spec) -> dict:
    base = {"model": {"uri": "hf://org/model"}}
    base.update(spec)
    return {"metadata": {"name": "m", "namespace": "default"}, "spec": base}


class Events(list):
    """Records the Events a converge pass posts: (type, reason, message)."""

    def __call__(self, type_, reason, message):
        self.append((type_, reason, message))


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch, as the API server applies `application/merge-patch+json`:
    objects merge key by key (recursively), `null` deletes the key, anything else (lists
    included) replaces the value."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _keep_foreign_ports(obj: dict, old: dict | None, last: dict | None) -> None:
    """Server-side apply on a Service's ports (a list map keyed by port): entries this
    manager never applied stay; two ports with one name are invalid (422)."""
    ours = {p["port"] for p in ((last or {}).get("spec") or {}).get("ports", [])}
    want = {p["port"] for p in obj["spec"]["ports"]}
    for port in ((old or {}).get("spec") or {}).get("ports", []):
        if port["port"] not in ours | want:
            obj["spec"]["ports"].append(copy.deepcopy(port))
    names = [p.get("name") for p in obj["spec"]["ports"]]
    if len(names) != len(set(names)):
        exc = ApiException(status=422, reason="Unprocessable Entity")
        exc.body = json.dumps({"kind": "Status", "message": f'Service "{obj["metadata"]["name"]}" '
                               'is invalid: spec.ports[1].name: Duplicate value: "http"'})  # fmt: skip
        raise exc


def with_status(body, cluster):
    """The object as the next watch event would deliver it (status as the fake stores it)."""
    body = copy.deepcopy(body)
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    if key in cluster.stored_status:
        body["status"] = copy.deepcopy(cluster.stored_status[key])
    return body


class Watched(Mapping):
    """kopf's indexes as the operator's watches would fill them from the fake's objects:
    index id -> (namespace, owner) -> objects. `lag` freezes them (a watch not caught up)."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.frozen: dict | None = None

    def _build(self) -> dict:
        out: dict = {k.index_id: {} for k in INDEXED_KINDS}
        by_kind = {k.kind: k for k in INDEXED_KINDS}
        objects = [(k, o) for (k, _, _), o in self.cluster.objects.items() if k in by_kind]
        for kind_name, obj in [*objects, *(("Pod", p) for p in self.cluster.pods)]:
            kind = by_kind[kind_name]
            key = index_key(kind, obj)
            if key:
                out[kind.index_id].setdefault(key, []).append(copy.deepcopy(obj))
        return out

    def lag(self) -> None:
        self.frozen = self._build()

    def catch_up(self) -> None:
        self.frozen = None

    def __getitem__(self, index_id):
        return (self.frozen or self._build())[index_id]

    def __iter__(self):
        return iter(k.index_id for k in INDEXED_KINDS)

    def __len__(self) -> int:
        return len(INDEXED_KINDS)


class FakeCluster:
    """In-memory API server stand-in: stores applied objects, adds server-side defaults and a
    status like a real one would, and counts every call by verb. `memo` is what kopf hands the
    handlers: the runtime kopf's startup wires (`runtime_for`), around this cluster and
    `memory`, a `Memory` over `watched`, the fake's objects as the watches would index them
    (reading them is no API call). Assign `runtime` to hand the handlers another one."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.pods: list[dict] = []
        self.calls: list[tuple[str, str]] = []
        self.status_patches: list[dict] = []  # the merge patches, as sent
        self.statuses: list[dict] = []  # the whole status after each patch
        self.stored_status: dict[tuple[str, str], dict] = {}  # (namespace, name) -> stored status
        self.fail_with = None  # exception to raise on the next write
        self.applied: dict[tuple[str, str, str], dict] = {}  # key -> the last manifest applied
        self.scaled: list[tuple[str, str, str, int]] = []  # (kind, namespace, name, replicas)
        self._revisions = itertools.count(1)
        self.watched = Watched(self)
        self.memory = ClusterView(self.watched)
        self._runtime: Runtime | None = None

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            self._runtime = runtime_for(self)
        return self._runtime

    @runtime.setter
    def runtime(self, runtime: Runtime) -> None:
        self._runtime = runtime

    @property
    def memo(self) -> kopf.Memo:
        return kopf.Memo(runtime=self.runtime)

    def _bump(self, obj: dict) -> None:
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._revisions))

    def reads(self) -> list[tuple[str, str]]:
        return [c for c in self.calls if c[0] in ("get", "list")]

    def _key(self, kind, namespace, name):
        return (kind, namespace, name)

    def writes(self) -> list[tuple[str, str]]:
        return [
            c
            for c in self.calls
            if c[0] in ("apply", "replace_lists", "delete", "patch_status", "scale")
        ]

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind))
        obj = self.objects.get(self._key(kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("apply", manifest["kind"]))
        if self.fail_with:
            exc, self.fail_with = self.fail_with, None
            raise exc
        obj = copy.deepcopy(manifest)
        meta = obj["metadata"]
        key = self._key(obj["kind"], meta["namespace"], meta["name"])
        old = self.objects.get(key)
        meta["generation"] = (old or {}).get("metadata", {}).get("generation", 0) + 1
        meta.setdefault("uid", f"uid-{obj['kind'].lower()}")
        if obj["kind"] == "Deployment":  # server-side defaults the operator must not fight
            tpl = obj["spec"]["template"]["spec"]
            tpl.setdefault("dnsPolicy", "ClusterFirst")
            tpl["containers"][0].setdefault("terminationMessagePath", "/dev/termination-log")
        if obj["kind"] in ("Deployment", "LeaderWorkerSet"):  # replicas and status kept
            obj["spec"].setdefault("replicas", (old or {}).get("spec", {}).get("replicas", 1))
            obj["status"] = (old or {}).get("status") or {"observedGeneration": meta["generation"]}
        if obj["kind"] == "Service":
            obj["spec"]["clusterIP"] = "10.0.0.10"
            _keep_foreign_ports(obj, old, self.applied.get(key))
        self.applied[key] = copy.deepcopy(manifest)
        self._bump(obj)
        self.objects[key] = obj
        return copy.deepcopy(obj)

    def replace_lists(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("replace_lists", manifest["kind"]))
        meta = manifest["metadata"]
        key = self._key(manifest["kind"], meta["namespace"], meta["name"])
        content = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata")}
        self.objects[key] = merge_patch(self.objects[key], content)
        self.applied.pop(key, None)  # the entries are this manager's again, as one write
        self._bump(self.objects[key])
        return copy.deepcopy(self.objects[key])

    def edit_service_port(self, namespace, name, port):
        """A hand edit (`kubectl patch --type json`) of the first port: the entry changes
        hands, so an apply no longer removes it (server-side apply's list-map ownership)."""
        self.objects[("Service", namespace, name)]["spec"]["ports"][0]["port"] = port

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.calls.append(("delete", kind))
        self.objects.pop(self._key(kind, namespace, name), None)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls.append(("list", "Pod"))
        return copy.deepcopy(self.pods)

    def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int
    ) -> dict[str, Any] | None:
        """The scale subresource: only spec.replicas changes (a new resourceVersion)."""
        self.calls.append(("scale", kind))
        self.scaled.append((kind, namespace, name, replicas))
        obj = self.objects[self._key(kind, namespace, name)]
        obj["spec"]["replicas"] = replicas
        self._bump(obj)
        return {"kind": "Scale", "metadata": {"name": name, "namespace": namespace,
                "resourceVersion": obj["metadata"]["resourceVersion"]},
                "spec": {"replicas": replicas}}  # fmt: skip

    def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any] | None:
        self.calls.append(("patch_status", "StreamingModel"))
        self.status_patches.append(copy.deepcopy(patch))
        stored = self.objects.get(("StreamingModel", namespace, name))
        before = self.stored_status.get((namespace, name), (stored or {}).get("status") or {})
        after = merge_patch(before, patch)
        self.stored_status[(namespace, name)] = after
        self.statuses.append(copy.deepcopy(after))
        if stored is not None:
            stored["status"] = copy.deepcopy(after)
            self._bump(stored)
            return copy.deepcopy(stored)
        return None

    def store(self, body: dict) -> dict:
        """Put a StreamingModel into the fake API server (handlers read it fresh)."""
        meta = body["metadata"]
        stored = copy.deepcopy(body)
        stored.setdefault("kind", "StreamingModel")
        self._bump(stored)
        self.objects[("StreamingModel", meta["namespace"], meta["name"])] = stored
        return body

    def set_deployment_status(self, namespace, name, kind="Deployment", **status):
        dep = self.objects[(kind, namespace, name)]
        dep["status"] = {"observedGeneration": dep["metadata"]["generation"], **status}
        self._bump(dep)


def runtime_for(
    cluster: FakeCluster,
    memory: ClusterView | None = None,
    leadership: Leadership | None = None,
    **options: Any,
) -> Runtime:
    """The operator's runtime as kopf's startup wires it (`wiring.wire`), around the fake
    cluster and its memory (or `memory`), with `options` (`wiring.Options`); nothing started."""
    return wire(
        Options(**options), kopf.OperatorSettings(), logging.getLogger("test"),
        cluster=cluster, memory=cluster.memory if memory is None else memory,
        leadership=leadership,
    )  # fmt: skip


class AbsentKind(FakeCluster):
    """Kinds the cluster cannot serve (one, or several), answered as a real API server and
    `KubeCluster` would: 404 (the CRD is not installed: a GET finds nothing, which
    `KubeCluster.get` reads as None, and an apply fails), 403 (the chart grants no access:
    every call fails), or any other status (every call fails). `refuse = 0`: installed and
    granted from then on."""

    def __init__(self, kind: str | tuple[str, ...], refuse: int) -> None:
        super().__init__()
        self.kinds = {kind} if isinstance(kind, str) else set(kind)
        self.refuse = refuse

    def _check(self, kind: str, verb: str) -> None:
        if kind not in self.kinds or not self.refuse:
            return
        if self.refuse == 404 and verb in ("get", "delete"):
            return  # no such object: `KubeCluster` answers None, and deleting it is a no-op
        raise ApiException(status=self.refuse, reason=f"{kind} refused by the test")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._check(kind, "get")
        return super().get(api_version, kind, namespace, name)

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self._check(manifest["kind"], "apply")
        return super().apply(manifest)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._check(kind, "delete")
        return super().delete(api_version, kind, namespace, name)
