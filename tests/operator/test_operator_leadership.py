"""The handlers under leader election: a standby writes nothing, a leader that loses the
Lease mid-pass sends nothing more, a new leader converges every model from memory at once.

The fence is a flag here (`Switch`); `test_operator_election.py` tests when the real one
opens and closes."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

import kopf
import pytest
from operator_helpers import FakeCluster, body_of, minimal, runtime_for
from sluice_operator import handlers, kopfwrites
from sluice_operator.cluster import FencedCluster, KubeLeases, WriteFenced
from sluice_operator.election import LeaseRecord
from sluice_operator.wiring import Options

LOG = logging.getLogger("test")


class Switch:
    def __init__(self, on: bool) -> None:
        self.on = on

    def leading(self) -> bool:
        return self.on


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    fake = FakeCluster()
    fake.runtime = runtime_for(fake, leadership=Switch(False), resync_seconds=3600)
    return fake


def _kwargs(cluster, body):
    cluster.store(body)
    meta = body["metadata"]
    return dict(body=body, namespace=meta["namespace"], name=meta["name"], memo=cluster.memo,
                retry=0, logger=LOG)  # fmt: skip


def test_a_standby_runs_no_model_handler_and_no_child_pass(cluster):
    body = body_of(minimal())
    cluster.store(body)
    assert handlers._leading(memo=cluster.memo) is False  # kopf's `when=` filter
    child = {"metadata": {"name": "m", "labels": {"app.kubernetes.io/instance": "m"}}}
    handlers._owner_changed(child, "default", cluster.memo, LOG, "MODIFIED")
    resync = cluster.runtime.resync
    resync.adopt_context()
    resync.run_once()
    assert cluster.calls == [] and resync.passes == 0


def test_model_handlers_are_filtered_on_leadership():
    registry = kopf._core.intents.registries.get_default_registry()
    model_handlers = [h for h in registry._changing.get_all_handlers() if h.id == "reconcile"]
    assert len(model_handlers) == 3  # create, update, resume
    assert all(h.when is handlers._leading for h in model_handlers)


def test_the_fence_refuses_every_write_and_lets_reads_through(cluster):
    fenced = cluster.runtime.cluster
    assert isinstance(fenced, FencedCluster)
    assert fenced.get("apps/v1", "Deployment", "default", "m") is None
    for call in (
        lambda: fenced.apply({"kind": "Service"}),
        lambda: fenced.replace_lists({"kind": "Service"}),
        lambda: fenced.delete("v1", "Service", "default", "m"),
        lambda: fenced.patch_status("default", "m", {}),
    ):
        with pytest.raises(WriteFenced):
            call()
    assert cluster.writes() == []


def test_losing_the_lease_mid_pass_stops_the_pass_quietly(cluster, monkeypatch, caplog):
    """The fence closes after the first child: nothing more is sent (no status, no Event),
    and the handler neither raises (no kopf retry, no Warning Event) nor crashes."""
    cluster.runtime.leadership.on = True
    posted = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: posted.append(kw))
    real_apply = cluster.apply

    def apply_then_lose(manifest):
        out = real_apply(manifest)
        cluster.runtime.leadership.on = False
        return out

    monkeypatch.setattr(cluster, "apply", apply_then_lose)
    with caplog.at_level(logging.INFO, logger="sluice_operator.passes"):
        handlers.reconcile(**_kwargs(cluster, body_of(minimal())))
    assert cluster.writes() == [("apply", "Service")]
    assert posted == [] and cluster.status_patches == []
    assert any("stopped: not the leader" in r.getMessage() for r in caplog.records)


def test_a_new_leader_converges_every_model_from_memory_at_once(cluster):
    """`kick()` (what becoming the leader calls) runs a round now, not at the next period."""
    for name in ("a", "b", "c"):
        cluster.store(body_of(minimal() | {"metadata": {"name": name, "namespace": "default"}}))
    resync = cluster.runtime.resync
    resync.adopt_context()
    done = threading.Event()
    real = resync.run_once

    def run_once():
        real()
        done.set()

    resync.run_once = run_once
    resync.start()
    try:
        cluster.runtime.leadership.on = True
        resync.kick()
        assert done.wait(10), "the kicked round did not run"
    finally:
        resync.stop()
    applied = {name for (kind, _, name) in cluster.objects if kind == "Deployment"}
    assert applied == {"a", "b", "c"} and resync.passes == 3


@pytest.mark.parametrize("leading", [False, True])
def test_kopfs_annotations_are_written_by_the_leader_only(leading):
    switch = Switch(leading)
    diffbase = kopfwrites.LeaderOnlyDiffBase(
        switch.leading, prefix="serving.sluice.dev", key="last-handled-configuration"
    )
    progress = kopfwrites.LeaderOnlyProgress(switch.leading, prefix="serving.sluice.dev")
    body = kopf.Body({"metadata": {"name": "m", "namespace": "default"}, "spec": {}})
    patch = kopf.Patch()
    diffbase.store(body=body, patch=patch, essence={"spec": {"x": 1}})
    progress.touch(body=body, patch=patch, value="1")
    assert bool(patch) is leading


def test_user_agent_names_the_replica():
    assert kopfwrites.user_agent("sluice-operator-7d9f-abcde") == (
        f"sluice-operator/{kopfwrites.__version__} (sluice-operator-7d9f-abcde)"
    )


def test_kopfs_session_carries_the_user_agent(monkeypatch):
    info = kopf.ConnectionInfo(server="https://127.0.0.1:6443", token="t0k3n")
    monkeypatch.setattr(kopf, "login_via_client", lambda **kw: info)
    memo = kopf.Memo(options=Options(identity="pod-a"))

    async def main():
        creds = await handlers.login(memo=memo, logger=LOG, settings=None)
        headers = creds.aiohttp_session.headers
        await creds.aiohttp_session.close()
        return creds, headers

    creds, headers = asyncio.run(main())
    assert headers["User-Agent"] == kopfwrites.user_agent("pod-a")
    assert headers["Authorization"] == "Bearer t0k3n"
    assert creds.server == info.server


class _RecordingCluster:
    def __init__(self, answers):
        self.answers, self.sent = answers, []

    def _call(self, method, path, *, body=None, content_type=None, timeout=None, query=None):
        self.sent.append((method, path, body, timeout))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_kube_leases_speaks_get_post_put_with_the_resource_version():
    from kubernetes.client.exceptions import ApiException

    lease = {
        "metadata": {"name": "sluice-operator", "namespace": "ns", "resourceVersion": "7"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 2},
    }
    missing, conflict = ApiException(status=404), ApiException(status=409)
    cluster = _RecordingCluster([missing, lease, lease, conflict])
    leases = KubeLeases(cluster, "ns", "sluice-operator", timeout=10)

    async def main():
        assert await leases.get() is None
        created = await leases.create(LeaseRecord("a", 15, "t", "t"))
        assert created.resource_version == "7" and created.transitions == 2
        await leases.update(created)
        with pytest.raises(Exception, match="changed first"):
            await leases.update(created)

    asyncio.run(main())
    methods = [(m, p.rsplit("/", 1)[-1]) for m, p, _, _ in cluster.sent]
    assert methods == [("GET", "sluice-operator"), ("POST", "leases"),
                       ("PUT", "sluice-operator"), ("PUT", "sluice-operator")]  # fmt: skip
    put_body = cluster.sent[2][2]
    assert put_body["metadata"]["resourceVersion"] == "7"
    assert put_body["spec"]["holderIdentity"] == "a"
    assert all(timeout == 10 for *_, timeout in cluster.sent)


def test_a_lease_won_during_start_up_converges_once_the_listings_are_complete(cluster):
    """The Lease can be won before kopf's first handler (its listings not complete): that
    round waits for the first handler's context instead of being lost."""
    cluster.store(body_of(minimal()))
    cluster.runtime.leadership.on = True
    resync = cluster.runtime.resync
    resync.run_once()  # the kicked round, before any handler ran
    assert resync.passes == 0 and not resync._kicked.is_set()
    resync.adopt_context()  # kopf's first handler
    assert resync._kicked.is_set()
    resync.run_once()
    assert resync.passes == 1 and ("Deployment", "default", "m") in cluster.objects


def test_kopfs_own_requests_write_only_while_leading():
    """kopf retries a failed patch or Event for up to a minute: its session's middleware
    refuses every write (nothing sent) once the fence is closed; reads always pass."""
    import aiohttp
    from yarl import URL

    switch = Switch(False)
    fence = kopfwrites.write_fence(switch.leading)
    sent = []

    async def handler(request):
        sent.append(request.method)
        return "response"

    def request(method):
        return SimpleNamespace(method=method, url=URL("https://api/apis/x/v1/namespaces/n/y/m"))

    async def main():
        assert await fence(request("GET"), handler) == "response"
        for method in ("PATCH", "POST", "PUT", "DELETE"):
            with pytest.raises(aiohttp.ClientConnectionError, match="not the leader"):
                await fence(request(method), handler)
        switch.on = True
        assert await fence(request("PATCH"), handler) == "response"

    asyncio.run(main())
    assert sent == ["GET", "PATCH"]


def test_startup_wires_the_election_into_the_fence_kopfs_events_and_the_resync(monkeypatch):
    """`--leader-elect`: the composition root hands the one Elector to every writer (the
    pass's fence, kopf's storages and Events) and its start to the resync; without the flag
    kopf posts Events from the start and writes are never fenced."""
    from sluice_operator import wiring
    from sluice_operator.election import ElectionSettings, Elector

    api = SimpleNamespace()
    monkeypatch.setattr(wiring, "_load_kube_config", lambda: api)
    election = ElectionSettings(name="sluice-operator", namespace="ops", identity="pod-a_1")
    settings = kopf.OperatorSettings()
    options = Options(identity="pod-a", election=election)
    runtime = wiring.wire(options, settings, LOG)
    assert isinstance(runtime.elector, Elector) and runtime.leadership is runtime.elector
    assert api.user_agent == kopfwrites.user_agent("pod-a")
    fenced = runtime.cluster
    assert isinstance(fenced, FencedCluster) and fenced.may_write == runtime.elector.leading
    assert not runtime.leading() and settings.posting.enabled is False
    assert isinstance(settings.persistence.progress_storage, kopfwrites.LeaderOnlyProgress)
    runtime.elector._on_started()  # what winning the Lease calls, on kopf's loop
    assert settings.posting.enabled is True and runtime.resync._kicked.is_set()
    runtime.elector._on_stopped("lost")
    assert settings.posting.enabled is False
    # Negative control: one replica, no election.
    single = kopf.OperatorSettings()
    runtime = wiring.wire(Options(), single, LOG)
    assert runtime.elector is None and runtime.leading() and single.posting.enabled is True
