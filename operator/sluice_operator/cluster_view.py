"""What the operator believes is in the cluster: the watches' indexes plus its own writes.

A converging pass reads the StreamingModel, its children and its pods from here, never from
the API: kopf's in-memory indexes (`@kopf.index`, registered in `handlers` for every kind in
`kinds.INDEXED_KINDS`) hold the latest object each watch delivered, keyed by
(namespace, owner) where the owner is the model's name (its own name for a StreamingModel,
the `app.kubernetes.io/instance` label for children and pods). kopf fills them from the
initial listing before any handler runs, so a missing object is absent, not unknown.

The watch lags the operator's own writes by a few milliseconds to seconds: right after a
create the index has nothing yet, right after a delete it still has the object. So every
write's result is remembered (`wrote`, `deleted`) and preferred over the index until the
watch shows that write or a later one (resourceVersions compared as the etcd revisions they
are); a DELETED event drops the memory of the object (`forget`). A pass that follows
another therefore neither re-creates a child nor writes a status twice, and the remembered
writes do not pile up: each lives only until the watch catches up.

Pure: no kopf and no API client; the indexes are any mapping id -> key -> objects.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from .builders.common import INSTANCE_LABEL
from .kinds import INDEXED_KINDS, POD, STREAMING_MODEL, Kind

Indexes = Mapping[str, Mapping[tuple[str, str], Iterable[Mapping[str, Any]]]]


def _revision(obj: Mapping[str, Any]) -> int | None:
    version = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(version) if version is not None else None
    except (TypeError, ValueError):
        return None


class ClusterView:
    """The watched objects (attached kopf indexes) overlaid with the operator's own writes.

    Thread-safe: kopf mutates the indexes on its event loop while passes read them from
    worker threads; every read copies what it needs under the GIL (`list(...)`).
    """

    def __init__(self, indexes: Indexes | None = None) -> None:
        self._indexes: Indexes | None = indexes
        self._guard = threading.Lock()
        self._own: dict[tuple[str, str, str], dict[str, Any]] = {}
        # Children nothing watches or reads (kinds.WRITE_ONLY_KINDS): (namespace, owner,
        # role) -> the hash of the manifest last applied, never the object.
        self._applied: dict[tuple[str, str, str], str] = {}

    @property
    def attached(self) -> bool:
        return self._indexes is not None

    def attach(self, indexes: Indexes) -> None:
        """Use these indexes (kopf passes them to every handler); the first call wins."""
        if self._indexes is None:
            self._indexes = {k.index_id: indexes[k.index_id] for k in INDEXED_KINDS}

    def __len__(self) -> int:
        """How many own writes the watches have not shown yet (bounded by the test)."""
        with self._guard:
            return len(self._own)

    # --- reads ----------------------------------------------------------------------
    def _watched(self, kind: Kind, namespace: str, owner: str) -> list[Mapping[str, Any]]:
        if self._indexes is None:
            raise RuntimeError("memory read before the watches' indexes were attached")
        index = self._indexes[kind.index_id]
        return list(index.get((namespace, owner)) or ())

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object named `name` (a child: its model's name, plus the kind's suffix)."""
        owner = kind.owner_of(name)
        watched = [o for o in self._watched(kind, namespace, owner) if _name(o) == name]
        seen = max(watched, key=lambda o: _revision(o) or 0) if watched else None
        key = (kind.kind, namespace, name)
        with self._guard:
            own = self._own.get(key)
            if own is None:
                return dict(seen) if seen is not None else None
            gone = own.get("kind") is None  # our delete: {"metadata": {resourceVersion}}
            mine = _revision(own) or 0
            if seen is not None and (_revision(seen) or 0) >= mine + gone:
                # The watch has caught up with our write (or shows a later change, or an
                # object made after our delete).
                del self._own[key]
                return dict(seen)
            return None if gone else dict(own)

    def model(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(STREAMING_MODEL, namespace, name)

    def pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        return [dict(p) for p in self._watched(POD, namespace, owner)]

    def every(self, kind: Kind) -> list[tuple[tuple[str, str], dict[str, Any] | None]]:
        """((namespace, owner), object) for every owner the watch has an object of `kind`
        for, each read like `get` (own writes preferred until the watch shows them)."""
        if self._indexes is None:
            return []
        return [(key, self.get(kind, *key)) for key in list(self._indexes[kind.index_id])]

    def models(self) -> list[tuple[str, str]]:
        """(namespace, name) of every StreamingModel the watch knows."""
        if self._indexes is None:
            return []
        return list(self._indexes[STREAMING_MODEL.index_id])

    # --- the operator's own writes ----------------------------------------------------
    def wrote(self, obj: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """Remember what a write returned (the object as stored); returns it."""
        if not obj:
            return None
        meta = obj.get("metadata") or {}
        key = (obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))
        if _revision(obj) is not None:
            with self._guard:
                self._own[key] = lean(obj)
        return dict(obj)

    def deleted(self, kind: Kind, namespace: str, name: str, last: Mapping[str, Any]) -> None:
        """We deleted `last` (as read): until the DELETED event the index still has it."""
        marker = {
            "metadata": {"resourceVersion": (last.get("metadata") or {}).get("resourceVersion")}
        }
        with self._guard:
            self._own[(kind.kind, namespace, name)] = marker

    def applied(self, kind: Kind, namespace: str, owner: str) -> str | None:
        """The hash of the manifest of a child that is never read (`kinds.WRITE_ONLY_KINDS`)
        as this process last applied it; None: not since the operator started, or deleted."""
        with self._guard:
            return self._applied.get((namespace, owner, kind.id))

    def remember_applied(self, kind: Kind, namespace: str, owner: str, digest: str | None) -> None:
        with self._guard:
            if digest is None:
                self._applied.pop((namespace, owner, kind.id), None)
            else:
                self._applied[(namespace, owner, kind.id)] = digest

    def prune(self) -> None:
        """Forget own writes of models the watch no longer has (deleted right after a write),
        and what was applied for them."""
        known = set(self.models())
        with self._guard:
            for key in [k for k in self._own if (k[1], k[2]) not in known]:
                del self._own[key]
            for applied in [k for k in self._applied if (k[0], k[1]) not in known]:
                del self._applied[applied]

    def forget(self, kind_name: str, namespace: str, name: str) -> None:
        """The watch showed the object deleted: the index dropped it, so do we."""
        with self._guard:
            self._own.pop((kind_name, namespace, name), None)


def lean(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy without `metadata.managedFields` (often the largest part of an object,
    never read by a pass): what memory keeps of every object."""
    out = dict(obj)
    meta = out.get("metadata")
    if isinstance(meta, Mapping) and "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return out


def _name(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("name")


def index_key(kind: Kind, body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, owner) under which an object is indexed, or None for none."""
    meta = body.get("metadata") or {}
    if kind is STREAMING_MODEL:
        owner = meta.get("name")
    else:
        owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    namespace = meta.get("namespace")
    return (namespace, owner) if namespace and owner else None
