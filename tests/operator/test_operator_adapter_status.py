"""status.adapters from the pods' own /metrics pages (adapterstatus.py), the AdapterFailed
Event, and the re-check while an adapter is loading; against the fake API server."""

from __future__ import annotations

import logging

import kopf
import pytest
from operator_helpers import Events, FakeCluster, body_of, minimal, with_status
from sluice_operator import handlers, passes
from sluice_operator.adapterstatus import adapter_states, adapters_status
from sluice_operator.builders.adapters import adapter_id
from sluice_operator.builders.args import server_args
from sluice_operator.reconcile import converge
from sluice_operator.validation import load_model

NOW = "2026-12-01T06:00:00Z"
A = {"name": "support", "uri": "pvc://adapters/support"}
B = {"name": "sql", "uri": "hf://acme/sql-lora"}


def lora_model(adapters=(A, B), **spec):
    return load_model(minimal(adapters=list(adapters), **spec))


def ids(m):
    return {a.name: adapter_id(a) for a in m.spec.adapters}


def page(samples) -> str:
    """A pod's /metrics page as the server writes it: (adapter, id, state, reason, value)."""
    lines = ["# HELP sluice_adapter_state LoRA adapters", "# TYPE sluice_adapter_state gauge"]
    for adapter, id_, state, reason, value in samples:
        lines.append(f'sluice_adapter_state{{adapter="{adapter}",id="{id_}",model="m",'
                     f'reason="{reason}",state="{state}"}} {value}')  # fmt: skip
    return "\n".join(lines) + "\nsluice_requests_total 3.0\n"


def pod(name, m, ready=True):
    return {
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"app.kubernetes.io/instance": "m",
                                "app.kubernetes.io/managed-by": "sluice-operator"}},
        "spec": {"containers": [{"name": "server", "args": server_args(m)}]},
        "status": {"podIP": "10.1.0.7",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def test_the_worst_state_of_a_pods_workers_wins_and_zeros_are_ignored():
    text = page([("a", "1", "Ready", "", "1.0"), ("a", "1", "Failed", 'bad \\"x\\"', "1.0"),
                 ("a", "1", "Loading", "", "0.0"), ("b", "2", "Ready", "", "1.0")])  # fmt: skip
    assert adapter_states(text) == {("a", "1"): ("Failed", 'bad "x"'), ("b", "2"): ("Ready", "")}


def test_every_state_from_two_pods():
    m = lora_model()
    i = ids(m)
    pods = [pod("p1", m), pod("p2", m), pod("p3", m, ready=False)]
    pages = {
        "p1": page([("support", i["support"], "Ready", "", 1), ("sql", i["sql"], "Ready", "", 1)]),
        # p2 still on the old list: it has support under an older id, sql failed.
        "p2": page(
            [
                ("support", "old-id", "Ready", "", 1),
                ("sql", i["sql"], "Failed", "LoRA rank 64 is greater than max_lora_rank 16.", 1),
            ]
        ),  # fmt: skip
    }
    entries, cond = adapters_status(m, pods, pages)
    by = {e["name"]: e for e in entries}
    assert by["support"]["state"] == "Loading" and "p2" in by["support"]["message"]
    assert by["sql"]["state"] == "Failed" and "max_lora_rank 16" in by["sql"]["message"]
    assert by["sql"]["readyPods"] == "1/2"  # the unready pod is not asked
    assert cond["reason"] == "AdapterFailed" and cond["status"] == "False"

    pages["p2"] = pages["p1"]
    entries, cond = adapters_status(m, pods, pages)
    assert [e["state"] for e in entries] == ["Ready", "Ready"] and cond["status"] == "True"


def test_unreadable_pods_make_adapters_unknown_never_failed():
    m = lora_model()
    entries, cond = adapters_status(m, [pod("p1", m)], {"p1": None})
    assert {e["state"] for e in entries} == {"Unknown"}
    assert "monitoringNamespaces" in entries[0]["message"]
    assert cond["status"] == "Unknown"


def test_no_lora_no_adapter_status():
    assert adapters_status(load_model(minimal()), [], {}) is None


def test_pods_on_other_lora_limits_say_the_engine_restarts():
    old = lora_model()
    new = lora_model(engine={"lora": {"maxLoras": 8}})
    i = ids(new)
    ok = page([(n, i[n], "Ready", "", 1) for n in i])
    _, cond = adapters_status(new, [pod("p1", old)], {"p1": ok})
    assert cond["reason"] == "EngineRestart" and "rolling update" in cond["message"]
    _, cond = adapters_status(new, [pod("p1", new)], {"p1": ok})
    assert cond["reason"] == "AllServed"


@pytest.fixture
def cluster():
    return FakeCluster()


def test_converge_writes_status_adapters_and_one_event_per_new_failure(cluster):
    body = body_of(minimal(adapters=[A, B]))
    m = load_model(body)
    i = ids(m)
    cluster.pods = [pod("m-1", m)]
    text = page([("support", i["support"], "Ready", "", 1),
                 ("sql", i["sql"], "Failed", "no adapter folder", 1)])  # fmt: skip
    events = Events()
    out = converge(cluster, body, events, now=NOW, pod_metrics=lambda p: text)
    status = cluster.statuses[-1]
    assert [(a["name"], a["state"]) for a in status["adapters"]] == [
        ("support", "Ready"), ("sql", "Failed")]  # fmt: skip
    cond = {c["type"]: c for c in status["conditions"]}["AdaptersReady"]
    assert cond["reason"] == "AdapterFailed"
    assert [r for _, r, _ in events if r == "AdapterFailed"] == ["AdapterFailed"]
    assert not out.adapters_settling
    # The next pass sees the same failure: no second Event, no status write.
    body = with_status(body, cluster)
    events.clear()
    converge(cluster, body, events, now=NOW, pod_metrics=lambda p: text)
    assert [r for _, r, _ in events if r == "AdapterFailed"] == []


def test_a_loading_adapter_makes_the_handler_look_again_soon(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal(adapters=[A]))
    m = load_model(body)
    cluster.pods = [pod("m-1", m)]
    cluster.store(body)
    kwargs = dict(body=body, namespace="default", name="m", memo=cluster.memo, retry=0,
                  logger=logging.getLogger("test"))  # fmt: skip
    loading = page([("support", ids(m)["support"], "Loading", "", 1)])
    monkeypatch.setattr(passes, "pod_metrics_page", lambda p: loading)
    with pytest.raises(kopf.TemporaryError) as exc:
        handlers.reconcile(**kwargs)
    assert exc.value.delay == passes.ADAPTER_RECHECK_SECONDS
    ready = page([("support", ids(m)["support"], "Ready", "", 1)])
    monkeypatch.setattr(passes, "pod_metrics_page", lambda p: ready)
    handlers.reconcile(**kwargs)  # settled: no retry
