"""LoRA adapters served next to the base model, from a watched file, without a restart.

The file (`--adapters-file`; on Kubernetes the `<name>-adapters` ConfigMap, mounted whole)
lists the adapters: `{"adapters": [{"name", "uri", "rank"?, "id"?}]}`. Every API worker of
a pod watches it as credential files are watched (`reload.stamp`: the kubelet swaps a
mounted ConfigMap in one rename), and brings its engine to the list: adapters that left are
unloaded, new ones (or a name whose `id` changed) loaded, one at a time, each on its own: an
adapter that fails is `Failed` with the engine's reason and the others keep serving. An
unusable file (bad JSON, a repeated name) changes nothing, as a bad key file does not.

`id` (the operator writes a digest of name and source) gives vLLM's integer LoRA id, so the
workers of a pod, each with its own client of the one engine core, address an adapter by
the same id. Without one it is derived from name and uri the same way.

Weights: a local folder is used in place; `hf://org/name[@revision]` is downloaded into the
Hugging Face cache (the pod's cache volume) under a file lock there, so the first worker
downloads and the others find the files: once per pod, not per worker.

A name resolves (`resolve`) to the base (None), to a Ready adapter, or to an ApiError: 503
while the adapter is still loading (Retry-After), 404 `model_not_found` naming what is
served otherwise; a caller whose key or token lists names (`models=`) gets 403 for others,
and sees only its names in `/v1/models` (`visible`).

State is exported as `sluice_adapter_state{adapter, id, state, reason}` (1 for the current
state, 0 for the others, the maximum over the pod's workers), which the operator reads to
fill the StreamingModel's status.adapters, and loads as `sluice_adapter_loads_total{result}`
and `sluice_adapter_load_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.base import Adapter, AdapterLoadError, Engine
from .auth.identity import MODEL_NAME, Principal
from .auth.reload import Stamp, stamp
from .errors import ApiError
from .telemetry.metrics import Metrics

log = logging.getLogger(__name__)

LOADING, READY, FAILED = "Loading", "Ready", "Failed"
NAME = MODEL_NAME
HF = re.compile(
    r"hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?)"
    r"(@(?P<rev>[A-Za-z0-9._/-]+))?"
)


@dataclass(frozen=True)
class Entry:
    """One adapter as the file lists it."""

    name: str
    uri: str
    id: str
    rank: int | None = None

    @property
    def lora_id(self) -> int:
        """vLLM's LoRA id (a positive int32), the same in every process that reads `id`."""
        return int(hashlib.sha256(self.id.encode()).hexdigest()[:8], 16) % (2**31 - 1) + 1


def parse_adapters(text: str, base: str) -> list[Entry]:
    """The file's adapters; ValueError naming what is wrong (the file is refused whole)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    items = doc.get("adapters") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise ValueError('expected {"adapters": [...]}')
    out: list[Entry] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"adapters[{i}]: needs a `name` (string)")
        name, uri = item["name"], item.get("uri")
        if not NAME.fullmatch(name):
            raise ValueError(f"adapters[{i}]: name {name!r} must match {NAME.pattern}")
        if name == base:
            raise ValueError(f"adapters[{i}]: {name!r} is the base model's name")
        if not isinstance(uri, str) or not (uri.startswith("/") or HF.fullmatch(uri)):
            raise ValueError(
                f"adapters[{i}] ({name}): uri must be an absolute path or hf://org/name[@revision]"
            )
        rank = item.get("rank")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
            raise ValueError(f"adapters[{i}] ({name}): rank must be a positive integer")
        given = item.get("id")
        digest = given if isinstance(given, str) and given else _digest(name, uri)
        out.append(Entry(name, uri, digest, rank))
    names = [e.name for e in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"a name appears twice: {', '.join(twice)}")
    return out


def _digest(name: str, uri: str) -> str:
    return hashlib.sha256(f"{name}\0{uri}".encode()).hexdigest()[:16]


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def fetch(uri: str) -> str:
    """The adapter's folder on this machine: a local path as is, an hf:// repo downloaded
    into the hub cache (the pod's cache volume) once per pod (blocking: run it in a thread)."""
    m = HF.fullmatch(uri)
    if m is None:
        if not os.path.isdir(uri):
            raise AdapterLoadError(f"no adapter folder at {uri}")
        return uri
    from huggingface_hub import snapshot_download

    repo, revision = m.group("repo"), m.group("rev")
    cache = hub_cache()
    locks = cache / ".sluice-locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / (_digest(repo, revision or "") + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait here, then find the files
        try:
            with contextlib.suppress(Exception):
                return snapshot_download(repo, revision=revision, local_files_only=True)
            return snapshot_download(
                repo,
                revision=revision,
                allow_patterns=["adapter_config.json", "*.safetensors", "*.bin", "*.json"],
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class Served:
    entry: Entry
    state: str
    reason: str = ""
    adapter: Adapter | None = None  # set while Ready


class Adapters:
    """The adapters this process serves and how its engine stands with each."""

    def __init__(
        self, base: str, metrics: Metrics, path: Path | None = None, interval: float = 2.0
    ) -> None:
        self.base, self.metrics, self.path, self.interval = base, metrics, path, interval
        self.served: dict[str, Served] = {}
        self.engine: Engine | None = None
        self._seen: Stamp = None
        self._lock = asyncio.Lock()
        self._exported: dict[str, tuple[str, str, str]] = {}  # name -> labels set to 1

    # -- serving ---------------------------------------------------------------------
    def names(self) -> list[str]:
        """What a client may name: the base and every Ready adapter."""
        return [self.base, *(n for n, s in self.served.items() if s.state == READY)]

    def resolve(self, name: str | None, who: Principal | None = None) -> Adapter | None:
        """The adapter to generate with (None: the base), or ApiError (see the module)."""
        target = self.base if name is None else name
        if who is not None and not who.may_use(target):
            raise ApiError(
                403,
                f"This key may not use the model `{target}`; it may use: "
                f"{', '.join(sorted(who.models or ()))}.",
                reason="auth",
                param="model",
                code="model_not_allowed",
            )
        if target == self.base:
            return None
        served = self.served.get(target)
        if served is not None and served.state == READY:
            return served.adapter
        if served is not None and served.state == LOADING:
            raise ApiError(
                503,
                f"The adapter `{target}` is still loading; retry shortly.",
                param="model",
                code="model_loading",
                headers={"Retry-After": "2"},
            )
        names = [n for n in self.names() if who is None or who.may_use(n)]
        raise ApiError(
            404,
            f"The model `{target}` does not exist; this server serves: "
            f"{', '.join(f'`{n}`' for n in names)}.",
            reason="bad_input",
            param="model",
            code="model_not_found",
        )

    @staticmethod
    def visible(listing: dict[str, Any], who: Principal) -> dict[str, Any]:
        """OpenAI's model list (`/v1/models`) as `who` may see it: only the served names its
        key or token lists (`models=`), every one when it lists none."""
        data = [m for m in listing.get("data") or [] if who.may_use(str(m.get("id")))]
        return {**listing, "data": data}

    # -- loading ---------------------------------------------------------------------
    def read(self) -> list[Entry] | None:
        """The file's list, or None when it is unusable (logged and counted)."""
        assert self.path is not None
        try:
            return parse_adapters(self.path.read_text(), self.base)
        except (OSError, ValueError) as e:
            self.metrics.adapter_loads.labels(self.metrics.model, "file_error").inc()
            log.warning(
                "adapters: %s cannot be used (%s: %s); keeping the adapters loaded before",
                self.path,
                type(e).__name__,
                e,
            )
            return None

    async def start(self, engine: Engine) -> None:
        """Load the file's adapters before the process reports ready (a restarted pod
        serves the current list at once); failures are per adapter, never fatal."""
        self.engine = engine
        if self.path is None:
            return
        self._seen = stamp(self.path)
        entries = self.read()
        if entries is not None:
            await self.apply(entries)

    async def check(self) -> None:
        if self.path is None or self.engine is None:
            return
        now = stamp(self.path)
        if now == self._seen:
            return
        self._seen = now
        entries = self.read()
        if entries is not None:
            await self.apply(entries)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one check must not end the watch
                log.exception("adapters: check failed")

    async def apply(self, entries: list[Entry]) -> None:
        """Bring the engine to `entries`: unload what left (or changed), then load the rest."""
        async with self._lock:
            engine = self.engine
            assert engine is not None
            want = {e.name: e for e in entries}
            for name, served in list(self.served.items()):
                if want.get(name) != served.entry:
                    del self.served[name]
                    self._export(name, None)
                    if served.adapter is not None:
                        with contextlib.suppress(Exception):
                            await engine.unload_adapter(served.adapter)
                        log.info("adapters: %s unloaded", name)
            new = [e for e in entries if e.name not in self.served]
            for e in new:  # Loading first, so a request for any of them gets a 503
                self._set(Served(e, LOADING))
            for e in new:
                await self._load(engine, e)

    async def _load(self, engine: Engine, e: Entry) -> None:
        t0 = time.perf_counter()
        try:
            path = await asyncio.to_thread(fetch, e.uri)
            adapter = Adapter(e.name, path, e.lora_id)
            await engine.load_adapter(adapter)
        except Exception as exc:
            reason = (
                str(exc) if isinstance(exc, AdapterLoadError) else (f"{type(exc).__name__}: {exc}")
            )
            self._set(Served(e, FAILED, reason[:300]))
            self.metrics.adapter_loads.labels(self.metrics.model, "failed").inc()
            log.warning("adapters: %s (%s) failed to load: %s", e.name, e.uri, reason)
            return
        seconds = time.perf_counter() - t0
        self._set(Served(e, READY, adapter=adapter))
        self.metrics.adapter_loads.labels(self.metrics.model, "ok").inc()
        self.metrics.adapter_load_seconds.labels(self.metrics.model).observe(seconds)
        log.info("adapters: %s loaded from %s in %.2f s", e.name, e.uri, seconds)

    def _set(self, served: Served) -> None:
        self.served[served.entry.name] = served
        self._export(served.entry.name, served)

    def _export(self, name: str, served: Served | None) -> None:
        gauge, model = self.metrics.adapter_state, self.metrics.model
        before = self._exported.pop(name, None)
        if before is not None:
            gauge.labels(model, name, *before).set(0)
        if served is None:
            return
        labels = (served.entry.id, served.state, served.reason)
        gauge.labels(model, name, *labels).set(1)
        self._exported[name] = labels

    def status(self) -> list[dict[str, Any]]:
        return [
            {"name": n, "id": s.entry.id, "state": s.state, "reason": s.reason}
            for n, s in self.served.items()
        ]
