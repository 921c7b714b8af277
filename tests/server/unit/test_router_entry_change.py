"""A changed models-file entry (router/app.py `Router.upstream`): the model's new Upstream
keeps what the router learned under the old one: its callers' tenants, and its streams in
flight, which keep counting against their pods (placement sees them) until they end."""

from __future__ import annotations

import json

import httpx
from sluice_server.router.app import build_router
from sluice_server.router.models import parse
from sluice_server.router.pods import Pod
from sluice_server.router.tenants import UNKNOWN
from sluice_server.router.upstream import Upstream
from sluice_server.settings import RouterSettings

KEY = "team-a/chat"
SELECTOR = {"app": "chat"}
TENANT = [(b"x-sluice-cache-tenant", b"team%20a")]


def entry(**fields) -> dict:
    pods = {"namespace": "team-a", "selector": SELECTOR, "port": 8000}
    return {"host": "chat.team-a.invalid", "pods": pods, **fields}


def pod(name: str, ip: str) -> Pod:
    return Pod(name, f"uid-{name}", ip, True, False, 0, ("c1",))


async def test_a_changed_entry_keeps_the_tenants_and_the_streams_in_flight(tmp_path):
    path = tmp_path / "models.json"
    path.write_text(json.dumps({KEY: entry()}))
    router = build_router(RouterSettings(models_file=path, kube_api_url=None))
    router.client = httpx.AsyncClient()
    try:
        model = router.models.by_key[KEY]
        assert model.pods is not None
        router.pods.podset(model.pods).replace([pod("pod-a", "10.0.0.1"), pod("pod-b", "10.0.0.2")])
        old = router.upstream(model)
        stream = old.pick(b"first", pin="pod-a")  # a long stream forwarded to pod-a
        assert stream is not None and old.in_flight == {"pod-a": 1}
        old.tenants.learn(b"cred", 200, TENANT)

        router.apply(parse({KEY: entry(holdTimeoutSeconds=60)}))  # the operator edits it
        changed = router.models.by_key[KEY]
        new = router.upstream(changed)
        assert new is not old and new.model.hold_timeout == 60
        # The caller's tenant stays learned: its next request is hashed, not load-placed.
        assert new.tenants.of(b"cred") == "team a"
        # The stream still counts against pod-a: the next request goes to idle pod-b.
        assert new.in_flight == {"pod-a": 1}
        pods = router.pods.podset(changed.pods)  # type: ignore[arg-type]

        def fresh(key: bytes) -> str | None:  # an Upstream that knows of no stream
            up = Upstream(changed, router.client, router.metrics, 1.0, 1.0, router.closing, pods)
            target = up.pick(key)
            return None if target is None else target.pod

        # A request the tie-break alone (nothing in flight) would send to pod-a ...
        key = next(k for k in (b"req-%d" % i for i in range(64)) if fresh(k) == "pod-a")
        nxt = new.pick(key)
        assert nxt is not None and nxt.pod == "pod-b"  # ... goes to pod-b: the stream counts
        # The old stream ends: released where the new entry counts it.
        stream.release()
        nxt.release()
        assert new.in_flight == {}
        # Control: another model starts with nothing learned (per model, not global).
        router.apply(parse({KEY: entry(), "team-b/other": entry(host="other.invalid")}))
        other = router.upstream(router.models.by_key["team-b/other"])
        assert other.tenants.of(b"cred") is UNKNOWN and other.in_flight == {}
    finally:
        await router.client.aclose()
