"""The models file: which models the router serves, and how (pure).

`{"<namespace>/<name>": {"host": "<name>.<namespace>.svc.cluster.local", "port": 8000,
"holdTimeoutSeconds": N, "maxHeld": M, "keepaliveSeconds": K, "pods": {...},
"balance": "least-loaded"}, ...}`,
written by the operator (its `<release>-activator-models` ConfigMap: one entry per model
at `autoscaling.minReplicas: 0` or routed by the router). A request names its model by its
Host header (the route rewrites it to the model Service's name; a port is ignored) or by
`X-Sluice-Model: <namespace>/<name>`; anything else is not the router's to forward (404),
so it is never an open proxy.

`pods`, `{"namespace": "<ns>", "selector": {<matchLabels of the model's serving pods>},
"port": 8000, "kvEvents": {"port": 5557, "replayPort": 5558}}`, makes the router watch those
Pods (pods.py) and send each request to one of them, `http://<podIP>:<port>`, placed by
podview.py; `kvEvents` (optional) says the pods publish their KV-cache events there, which
the router follows per pod (kvfeed.py). Without `pods` a request goes to the Service `host`,
as for a model that is only scaled to zero. `balance` is the model's `spec.routing.balance`
and says how a model with `pods` is placed: `least-loaded` (the default) by the router's
scores (prefix cache and load, placement.py), `round-robin` on each candidate pod in turn. `migration`, `{"maxMigrations": 3,
"stallSeconds": 30}` (a model with `pods` whose pods take continuations), makes the router
continue a stream whose pod breaks off on another pod (migration.py). `split`,
`{"versions": [{"model": "<ns>/<owner>", "weight": 90}, {"model": "<ns>/<version>",
"weight": 10}]}`, on the entry of the model that owns a public host (docs/versions.md), makes
the router send each conversation that names it to one of these versions (split.py): every
version listed, the owner first, integer weights 0..100 that sum to 100; each version is an
entry of the file itself (one that is not takes no share: its weight goes to the owner).
`disaggregation`, `{"prefill": {<a pod selector like pods>}}` (a model with `pods`, which are then its decode
pool), makes the router run each request's prompt on a prefill pod first and send the
request to a decode pod with the KV-transfer parameters the prefill returned
(docs/disaggregation.md). Fields the router does not know are ignored (an operator
newer than the router); a file that cannot be used raises ValueError naming the entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MODEL_HEADER = "x-sluice-model"
Balance = Literal["least-loaded", "round-robin"]


class _KvEvents(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    port: int = Field(ge=1, le=65535)
    replay_port: int | None = Field(None, ge=1, le=65535, alias="replayPort")


class _Pods(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    namespace: str = Field(min_length=1)
    selector: dict[str, str] = Field(min_length=1)  # never empty: that would be every pod
    port: int = Field(8000, ge=1, le=65535)
    kv_events: _KvEvents | None = Field(None, alias="kvEvents")


class _Migration(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    max_migrations: int = Field(3, ge=0, le=10, alias="maxMigrations")
    stall_seconds: float = Field(30.0, gt=0, alias="stallSeconds")


class _Version(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str = Field(min_length=3)
    weight: int = Field(ge=0, le=100, strict=True)


class _Split(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    versions: list[_Version] = Field(min_length=1)


class _Disaggregation(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    prefill: _Pods


class _Entry(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    host: str = Field(min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    hold_timeout: float = Field(600.0, gt=0, alias="holdTimeoutSeconds")
    max_held: int = Field(100, ge=1, alias="maxHeld")
    keepalive: float = Field(15.0, gt=0, alias="keepaliveSeconds")
    pods: _Pods | None = None
    balance: Balance = "least-loaded"
    migration: _Migration | None = None
    split: _Split | None = None
    disaggregation: _Disaggregation | None = None


@dataclass(frozen=True)
class KvEventPorts:
    """Where a model's pods publish their KV-cache events (vLLM's `--kv-events-config`):
    the PUB port, and the replay (ROUTER) port when they keep one."""

    port: int
    replay_port: int | None = None


@dataclass(frozen=True)
class PodSelector:
    """Which Pods serve a model: its namespace and label selector (matchLabels), the port
    its pods listen on, and their KV-event ports (None: they publish none)."""

    namespace: str
    labels: tuple[tuple[str, str], ...]  # sorted (key, value) pairs
    port: int = 8000
    kv_events: KvEventPorts | None = None

    @property
    def label_selector(self) -> str:
        """The `labelSelector` query parameter of a Pod list or watch."""
        return ",".join(f"{k}={v}" for k, v in self.labels)


@dataclass(frozen=True)
class Migration:
    """A model whose streams the router continues on another pod when theirs breaks
    (docs/migration.md): at most `max_migrations` moves per stream; an upstream silent for
    `stall_seconds` counts as broken."""

    max_migrations: int = 3
    stall_seconds: float = 30.0


@dataclass(frozen=True)
class Version:
    """One version of a split: a model of the file (`<namespace>/<name>`) and its weight."""

    key: str
    weight: int  # 0..100: its share of the owner's conversations, in percent


@dataclass(frozen=True)
class Split:
    """The versions an owner's conversations are shared among (split.py), the owner first;
    their weights sum to 100, and each takes the next `weight` of the range [0, 100)."""

    versions: tuple[Version, ...]


@dataclass(frozen=True)
class Model:
    namespace: str
    name: str
    host: str
    port: int
    hold_timeout: float  # seconds a request may wait for a ready replica
    max_held: int  # requests held at once; past it 429
    keepalive: float  # seconds between keep-alives on a held stream (and its commit point)
    pods: PodSelector | None = None  # None: forward to the Service `host`
    balance: Balance = "least-loaded"  # how a model with `pods` is placed
    migration: Migration | None = None  # None: its streams are not continued elsewhere
    split: Split | None = None  # None: its requests are its own, never shared with a version
    # Its prefill pool (`pods` is then the decode pool); None: not disaggregated.
    prefill: PodSelector | None = None
    # Which of a disaggregated model's pools this is (`prefill_pool`); None: the model itself.
    pool: Literal["prefill"] | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def pool_key(self) -> str:
        """The key of its pool's pod view and prompt hasher: the model's key, with
        `#prefill` for a disaggregated model's prefill pool."""
        return self.key if self.pool is None else f"{self.key}#{self.pool}"

    def prefill_pool(self) -> Model:
        """A disaggregated model's prefill pool as a model of its own (its pods the prefill
        pods; no migration: a prefill is retried whole, not continued), placed, viewed and
        hashed by the same machinery as any model's pods."""
        assert self.prefill is not None
        return replace(self, pods=self.prefill, migration=None, prefill=None, pool="prefill")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Models:
    """The loaded file: look-ups by key and by host."""

    def __init__(self, models: list[Model]) -> None:
        self.by_key = {m.key: m for m in models}
        self.by_host = {m.host.lower(): m for m in models}

    def __len__(self) -> int:
        return len(self.by_key)

    def find(self, host: str | None, named: str | None) -> Model | None:
        """The model a request is for: `X-Sluice-Model` first, else the Host (port stripped)."""
        if named:
            return self.by_key.get(named.strip())
        if not host:
            return None
        name = host.strip().lower()
        if name.startswith("["):  # an IPv6 literal: never a model's host name
            return None
        return self.by_host.get(name.rsplit(":", 1)[0] if ":" in name else name)


def parse(data: object) -> Models:
    if not isinstance(data, dict):
        raise ValueError('the models file must be a JSON object of "<namespace>/<name>": {...}')
    models = []
    for key, value in data.items():
        namespace, _, name = str(key).partition("/")
        if not namespace or not name or "/" in name:
            raise ValueError(f"entry {key!r}: the key must be <namespace>/<name>")
        try:
            entry = _Entry.model_validate(value)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or 'entry'}: {err['msg']}"
                for err in e.errors()
            )
            raise ValueError(f"entry {key!r}: {problems}") from None
        selector = _selector(entry.pods)
        prefill = None
        if entry.disaggregation is not None:
            if selector is None:
                raise ValueError(
                    f"entry {key!r}: disaggregation needs pods (the decode pool) beside "
                    "disaggregation.prefill"
                )
            prefill = _selector(entry.disaggregation.prefill)
        models.append(
            Model(
                namespace,
                name,
                entry.host,
                entry.port,
                entry.hold_timeout,
                entry.max_held,
                entry.keepalive,
                selector,
                entry.balance,
                None
                if entry.migration is None
                else Migration(entry.migration.max_migrations, entry.migration.stall_seconds),
                None if entry.split is None else _split(str(key), entry.split),
                prefill,
            )
        )
    return Models(models)


def _split(key: str, split: _Split) -> Split:
    """The entry's split, checked: the owner first, every version once, weights sum to 100."""
    versions = tuple(Version(v.model.strip(), v.weight) for v in split.versions)
    for v in versions:
        namespace, _, name = v.key.partition("/")
        if not namespace or not name or "/" in name:
            raise ValueError(f"entry {key!r}: split version {v.key!r} must be <namespace>/<name>")
    if versions[0].key != key:
        raise ValueError(
            f"entry {key!r}: split.versions must list the owner {key!r} first, "
            f"not {versions[0].key!r}"
        )
    keys = [v.key for v in versions]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"entry {key!r}: split.versions lists {', '.join(twice)} more than once")
    total = sum(v.weight for v in versions)
    if total != 100:
        raise ValueError(
            f"entry {key!r}: split weights must sum to 100, not {total} "
            f"({', '.join(f'{v.key}={v.weight}' for v in versions)})"
        )
    return Split(versions)


def _selector(pods: _Pods | None) -> PodSelector | None:
    if pods is None:
        return None
    kv = pods.kv_events
    return PodSelector(
        pods.namespace,
        tuple(sorted(pods.selector.items())),
        pods.port,
        None if kv is None else KvEventPorts(kv.port, kv.replay_port),
    )


def load(path: Path) -> Models:
    """The file as it is now (OSError when unreadable, ValueError when unusable)."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    return parse(data)
