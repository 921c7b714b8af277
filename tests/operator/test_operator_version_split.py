"""A model version to a share of traffic (spec.routing.router.split): the spec's rules, the
versions checked against the objects they name (condition TrafficSplit), the owner's entry
in models.json, status.split, and each version's numbers from its pods' /metrics pages."""

from __future__ import annotations

import json

import pytest
from operator_helpers import Events, FakeCluster, body_of, minimal
from prometheus_client import generate_latest
from sluice_operator.builders.activator import activator_entry, models_entries
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.builders.split import check_versions, split_condition, split_entry
from sluice_operator.reconcile import converge
from sluice_operator.scaletozero import ZeroContext
from sluice_operator.scaletozero_poller import ActivatorSettings, ScaleToZeroPoller
from sluice_operator.splitstats import Reading, VersionStats, quantile, reading, window
from sluice_operator.validation import SpecError, load_model, parse_spec
from sluice_server.core.telemetry.metrics import Metrics

NOW = "2026-12-05T06:00:00Z"
HOST = "sluice-activator.sluice-system.svc.cluster.local"


def version(name: str, served: str = "chat", router: bool = True, **spec) -> dict:
    body = body_of(
        minimal(
            model={"uri": "hf://org/model", "servedName": served},
            routing={"router": {"enabled": router}},
            **spec,
        )
    )
    body["metadata"]["name"] = name
    return body


def owner_body(*split: tuple[str, int], **spec) -> dict:
    body = version("chat", **spec)
    body["spec"]["routing"]["router"]["split"] = [{"model": m, "weight": w} for m, w in split]
    return body


def by_name(*bodies: dict) -> dict:
    return {b["metadata"]["name"]: load_model(b) for b in bodies}


# ---- the spec's rules -----------------------------------------------------------------------


def test_split_is_accepted_with_the_router_and_weights_up_to_100():
    spec = parse_spec(owner_body(("v2", 60), ("v3", 40))["spec"], name="chat")
    assert [(v.model, v.weight) for v in spec.routing.router.split] == [("v2", 60), ("v3", 40)]
    assert parse_spec(owner_body()["spec"], name="chat").routing.router.split == []


@pytest.mark.parametrize(
    ("split", "router", "message"),
    [
        ([("v2", 60), ("v3", 41)], True, "the weights must sum to at most 100 (this model keeps "
         "100 minus the sum) (they sum to 101: lower them)"),
        ([("v2", 10), ("v2", 5)], True, "each model may appear once (v2 appears more than once)"),
        ([("v2", 10)], False, "routing.router.split needs routing.router.enabled"),
        ([("chat", 10)], True, "split names the object itself: list the other versions only"),
        ([("v2", 101)], True, "less than or equal to 100"),
    ],
)  # fmt: skip
def test_split_rules_refuse_with_a_message(split, router, message):
    body = owner_body(*split)
    body["spec"]["routing"]["router"]["enabled"] = router
    with pytest.raises(SpecError) as info:
        load_model(body)
    assert message in str(info.value)
    assert info.value.field.startswith("spec.routing.router.split")


# ---- the versions checked against the objects they name ------------------------------------


def test_a_sound_version_takes_its_weight():
    chat = owner_body(("v2", 10))
    checks = check_versions(load_model(chat), by_name(chat, version("v2")))
    assert [(c.model, c.applied, c.reason) for c in checks] == [("v2", 10, "")]
    cond = split_condition(load_model(chat), checks)
    assert (cond["status"], cond["reason"]) == ("True", "Split")
    assert cond["message"] == "conversations split chat 90%, v2 10%"


@pytest.mark.parametrize(
    ("v2", "reason", "words"),
    [
        (None, "VersionMissing", "StreamingModel v2 does not exist in namespace default"),
        (version("v2", router=False), "VersionNotRouted",
         "set spec.routing.router.enabled: true on v2"),
        (version("v2", served="chat-next"), "ServedNameDiffers",
         "set spec.model.servedName: chat on v2"),
        (version("v2", ingress={"enabled": True, "host": "chat.example.com"}), "RouteClaimed",
         "v2's route claims chat.example.com/, which chat owns"),
        (version("v2", ingress={"enabled": True, "host": "v2.example.com", "path": "/v2"}),
         "PathDiffers", "v2's pods answer under /v2, chat's under /: "),
        (version("v2", gateway={"parentRefs": [{"name": "gw"}], "hostnames": ["chat.example.com"]}),
         "RouteClaimed", "which chat owns"),
    ],
)  # fmt: skip
def test_a_failing_version_takes_nothing_and_the_condition_says_why(v2, reason, words):
    chat = owner_body(("v2", 10), ingress={"enabled": True, "host": "chat.example.com"})
    models = by_name(chat) | (by_name(v2) if v2 is not None else {})
    owner_model = load_model(chat)
    checks = check_versions(owner_model, models)
    assert [(c.weight, c.applied, c.reason) for c in checks] == [(10, 0, reason)]
    cond = split_condition(owner_model, checks)
    assert (cond["status"], cond["reason"]) == ("False", reason)
    assert words in cond["message"]
    assert "chat takes v2's 10% (split now chat 100%, v2 0%)" in cond["message"]
    assert split_entry(owner_model, checks) == {
        "versions": [{"model": "default/chat", "weight": 100}, {"model": "default/v2", "weight": 0}]
    }


def test_other_hosts_and_paths_are_not_claims():
    chat = owner_body(("v2", 10), ingress={"enabled": True, "host": "chat.example.com"})
    for route in (
        {"ingress": {"enabled": True, "host": "canary.chat.example.com"}},
        {"ingress": {"enabled": True}},  # the default server: another server than chat's
        {"gateway": {"parentRefs": [{"name": "gw"}], "hostnames": ["canary.example.com"]}},
        {},
    ):
        checks = check_versions(load_model(chat), by_name(chat, version("v2", **route)))
        assert checks[0].reason == "", route
    # Without host names both claim the default server's path (negative control).
    bare = owner_body(("v2", 10), ingress={"enabled": True, "path": "/chat"})
    every = version("v2", ingress={"enabled": True, "path": "/chat"})
    assert check_versions(load_model(bare), by_name(bare, every))[0].reason == "RouteClaimed"
    # The same prefix on another host: the pods answer where the owner's do.
    canary = version("v2", ingress={"enabled": True, "host": "canary.example.com", "path": "/chat"})
    assert check_versions(load_model(bare), by_name(bare, canary))[0].reason == ""


def test_an_invalid_or_splitting_version_takes_nothing():
    chat = load_model(owner_body(("v2", 10)))
    assert check_versions(chat, {"v2": None})[0].reason == "VersionInvalid"
    nested = owner_body(("v3", 5))
    nested["metadata"]["name"] = "v2"
    assert check_versions(chat, by_name(nested))[0].reason == "VersionSplits"


def test_without_the_router_the_condition_says_so():
    chat = load_model(owner_body(("v2", 10)))
    off = chat.__class__(**{**chat.__dict__, "router_available": False})
    cond = split_condition(off, check_versions(off, by_name(version("v2"))))
    assert (cond["status"], cond["reason"]) == ("False", "RouterDisabled")


# ---- the owner's entry in models.json ---------------------------------------------------------


def test_models_file_gives_the_owner_its_split_and_leaves_the_others_alone():
    chat, v2, plain = owner_body(("v2", 10), ("v3", 5)), version("v2"), version("plain")
    entries = models_entries([load_model(b) for b in (chat, v2, plain)])
    assert entries["default/chat"]["split"] == {
        "versions": [
            {"model": "default/chat", "weight": 90},  # v3 does not exist: its 5% stays here
            {"model": "default/v2", "weight": 10},
            {"model": "default/v3", "weight": 0},
        ]
    }
    assert sum(v["weight"] for v in entries["default/chat"]["split"]["versions"]) == 100
    # The versions' and other models' entries are what they were without a split.
    assert entries["default/v2"] == activator_entry(load_model(v2))
    assert entries["default/plain"] == activator_entry(load_model(plain))
    assert "split" not in json.dumps(entries["default/v2"])
    # A version without the router has no entry: its share stays with the owner.
    off = version("v2", router=False)
    entries = models_entries([load_model(b) for b in (chat, off)])
    assert "default/v2" not in entries
    assert entries["default/chat"]["split"]["versions"][0]["weight"] == 100


def test_a_split_changes_no_pod_template():
    with_split = load_model(owner_body(("v2", 10)))
    without = load_model(owner_body())
    assert desired_deployment(with_split) == desired_deployment(without)


def test_poller_writes_the_split_and_wakes_the_owner_when_a_version_appears():
    cluster = FakeCluster()
    cluster.store(owner_body(("v2", 10)))
    woken: list[list[tuple[str, str]]] = []
    poller = ScaleToZeroPoller(
        cluster,
        cluster.memory,
        ActivatorSettings("sluice-activator", "sluice-system", "x=y"),
        wake=woken.append,
        page=lambda pod: None,
    )

    def listed() -> dict:
        cm = cluster.objects[("ConfigMap", "sluice-system", "sluice-activator-models")]
        return json.loads(cm["data"]["models.json"])

    poller.run_once()
    assert listed()["default/chat"]["split"]["versions"][1] == {"model": "default/v2", "weight": 0}
    assert woken == [[("default", "chat")]]
    poller.run_once()  # nothing changed: no pass
    assert len(woken) == 1
    cluster.store(version("v2"))
    poller.run_once()
    assert listed()["default/chat"]["split"]["versions"] == [
        {"model": "default/chat", "weight": 90},
        {"model": "default/v2", "weight": 10},
    ]
    assert woken[-1] == [("default", "chat")]


# ---- condition TrafficSplit and status.split from a pass ---------------------------------------


def test_pass_writes_the_condition_and_status_split():
    cluster = FakeCluster()
    chat = owner_body(("v2", 10))
    cluster.store(chat)
    v2 = version("v2", served="other")
    v2["status"] = {"readyReplicas": 2}
    cluster.store(v2)
    numbers = {("default", "v2"): VersionStats(42, "0.0100", 300, 15)}
    zero = ZeroContext(activator_host=HOST, split_stats=numbers.get)
    events = Events()
    converge(cluster, chat, events, now=NOW, zero=zero)
    status = cluster.stored_status[("default", "chat")]
    cond = {c["type"]: c for c in status["conditions"]}["TrafficSplit"]
    assert (cond["status"], cond["reason"]) == ("False", "ServedNameDiffers")
    assert status["split"] == [
        {"model": "chat", "weight": 100, "readyReplicas": 0},
        {
            "model": "v2",
            "weight": 0,
            "readyReplicas": 2,
            "ttftMilliseconds": 42,
            "errorRate": "0.0100",
            "tokensPerSecond": 300,
            "windowSeconds": 15,
        },
    ]
    assert ("Warning", "TrafficSplit") in [(t, r) for t, r, _ in events]
    # Fixed: the version takes its share, and the condition turns True.
    cluster.store(version("v2"))
    converge(cluster, chat | {"status": status}, events, now=NOW, zero=zero)
    status = cluster.stored_status[("default", "chat")]
    cond = {c["type"]: c for c in status["conditions"]}["TrafficSplit"]
    assert (cond["status"], cond["reason"]) == ("True", "Split")
    assert [(r["model"], r["weight"]) for r in status["split"]] == [("chat", 90), ("v2", 10)]


def test_a_model_without_a_split_has_no_condition_or_status_split():
    cluster = FakeCluster()
    body = owner_body()
    cluster.store(body)
    converge(cluster, body, Events(), now=NOW, zero=ZeroContext(activator_host=HOST))
    status = cluster.stored_status[("default", "chat")]
    assert "split" not in status
    assert "TrafficSplit" not in {c["type"] for c in status["conditions"]}


# ---- each version's numbers from its pods' pages ------------------------------------------------


def page(ttfts: list[float], tokens: int, errors: int = 0, metrics: Metrics | None = None):
    """A pod's /metrics page as the server writes it (its own Metrics), after `ttfts`
    requests on two protocols, `tokens` tokens and `errors` error events."""
    m = metrics or Metrics("chat")
    for i, t in enumerate(ttfts):
        labels = {"protocol": ("openai", "sse")[i % 2], "model": "chat"}
        m.ttft.labels(**labels).observe(t)
        m.requests.labels(**labels).inc()
    m.output_tokens.labels(protocol="openai", model="chat").inc(tokens)
    if errors:
        m.stream_errors.labels(protocol="sse", model="chat").inc(errors)
    return m, generate_latest(m.registry).decode()


def test_reading_sums_protocols_and_pods_over_a_window():
    m1, before1 = page([0.02] * 4, 100)
    m2, before2 = page([0.02] * 2, 50)
    _, after1 = page([0.04] * 10, 3000, errors=1, metrics=m1)
    _, after2 = page([0.2] * 10, 1500, errors=1, metrics=m2)
    before = {"a": reading(before1), "b": reading(before2)}
    after = {"a": reading(after1), "b": reading(after2)}
    stats = window(before, after, seconds=15)
    # 20 requests in the window: 10 at 40 ms (bucket 25-50 ms), 10 at 200 ms (150-200 ms).
    # The median is the 10th: the top of the 25-50 ms bucket, linearly.
    assert stats == VersionStats(50, "0.1000", 300, 15)
    assert reading(before1).requests == 4


def test_a_restarted_or_new_pod_adds_nothing_to_the_window():
    m, old = page([0.02] * 5, 500)
    _, restarted = page([0.3], 10)  # counters went down: a new process
    _, later = page([0.02] * 3, 90, metrics=m)
    stats = window({"a": reading(old)}, {"a": reading(restarted), "new": reading(later)}, 10)
    assert stats == VersionStats(None, None, 0, 10)


def test_quantile_reads_the_histogram_as_prometheus_does():
    buckets = ((0.1, 2.0), (0.2, 4.0), (float("inf"), 4.0))
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.75, buckets) == pytest.approx(0.15)
    assert quantile(0.5, ((0.1, 0.0), (float("inf"), 0.0))) is None
    assert quantile(0.99, ((0.1, 1.0), (float("inf"), 2.0))) == pytest.approx(0.1)
    assert Reading(1, 0, 5).minus(Reading(2, 0, 0)) is None
