"""The router's models file (router/models.py), its command line and what makes a pod a
candidate (router/pods.py): what maps a request to a model and its pods, and what a file or
a flag the router cannot use is told."""

from __future__ import annotations

import json

import pytest
from sluice_server.router.models import KvEventPorts, Migration, PodSelector, load, parse
from sluice_server.settings import RouterSettings, build_parser, parse_router_settings

FILE = {
    "team-a/chat": {"host": "chat.team-a.svc.cluster.local", "port": 8000,
                    "holdTimeoutSeconds": 360, "maxHeld": 50, "keepaliveSeconds": 15},
    "team-b/code": {"host": "code.team-b.svc.cluster.local"},
}  # fmt: skip


def test_a_request_is_for_the_model_its_host_or_header_names():
    models = parse(FILE)
    chat = models.by_key["team-a/chat"]
    assert (chat.namespace, chat.name, chat.port, chat.hold_timeout, chat.max_held,
            chat.keepalive) == ("team-a", "chat", 8000, 360, 50, 15)  # fmt: skip
    assert chat.url == "http://chat.team-a.svc.cluster.local:8000"
    for host in ("chat.team-a.svc.cluster.local", "Chat.Team-A.svc.cluster.local:8000",
                 "chat.team-a.svc.cluster.local:80"):  # fmt: skip
        assert models.find(host, None) is chat, host
    assert models.find("anything", "team-a/chat") is chat  # the header wins
    assert models.find("chat.team-a.svc.cluster.local", "team-b/other") is None
    for host in ("chat.team-a", "chat.team-a.svc", "code.team-a.svc.cluster.local", "", None,
                 "[::1]:8000"):  # fmt: skip
        assert models.find(host, None) is None, host
    code = models.by_key["team-b/code"]  # the defaults
    assert (code.port, code.hold_timeout, code.max_held, code.keepalive) == (8000, 600, 100, 15)


def test_unknown_fields_are_ignored_and_bad_entries_named(tmp_path):
    assert len(parse({"a/b": {"host": "h", "futureField": 1}})) == 1
    cases = [
        ([], "JSON object"),
        ({"chat": {"host": "h"}}, "entry 'chat': the key must be <namespace>/<name>"),
        ({"a/b/c": {"host": "h"}}, "the key must be"),
        ({"a/b": {"port": 8000}}, "entry 'a/b': host: Field required"),
        ({"a/b": {"host": "h", "maxHeld": 0}}, "maxHeld: Input should be greater than or equal"),
        ({"a/b": {"host": "h", "holdTimeoutSeconds": -1}}, "holdTimeoutSeconds"),
        ({"a/b": "h"}, "entry 'a/b'"),
    ]  # fmt: skip
    for data, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            parse(data)
    path = tmp_path / "models.json"
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        load(path)
    path.write_text(json.dumps(FILE))
    assert set(load(path).by_key) == set(FILE)


def test_migration_is_read_per_model_and_absent_means_none():
    """`migration` (docs/migration.md): how many moves and the stall, typed; absent: the
    router continues none of the model's streams. Unknown keys in it are ignored, a bad
    value names the entry and the field."""
    models = parse({
        "a/on": {"host": "on", "migration": {"maxMigrations": 0, "stallSeconds": 20.5,
                                             "future": 1}},
        "a/off": {"host": "off"},
    })  # fmt: skip
    on = models.by_key["a/on"].migration
    assert on == Migration(max_migrations=0, stall_seconds=20.5)
    assert (on.max_migrations, on.stall_seconds) == (0, 20.5)
    assert models.by_key["a/off"].migration is None
    for bad, field in [({"maxMigrations": -1, "stallSeconds": 30}, "maxMigrations"),
                       ({"maxMigrations": 3, "stallSeconds": 0}, "stallSeconds"),
                       ({"maxMigrations": 11, "stallSeconds": 30}, "maxMigrations")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"entry 'a/b': migration.{field}"):
            parse({"a/b": {"host": "h", "migration": bad}})


def test_disaggregation_names_the_prefill_pool_beside_the_decode_pods():
    """`disaggregation.prefill` (docs/disaggregation.md): a pod selector like `pods`, which
    are then the decode pool; the prefill pool is a model of its own for placement, with
    its own key. Without `pods` it is refused, naming the entry."""
    pods = {"namespace": "a", "selector": {"role": "decode"}, "port": 8000}
    prefill = {"namespace": "a", "selector": {"role": "prefill"}, "port": 8001,
               "kvEvents": {"port": 5557}, "future": 1}  # fmt: skip
    models = parse({
        "a/pd": {"host": "pd", "pods": pods, "migration": {}, "disaggregation": {"prefill": prefill}},
        "a/plain": {"host": "plain", "pods": pods},
    })  # fmt: skip
    pd = models.by_key["a/pd"]
    assert pd.prefill == PodSelector("a", (("role", "prefill"),), 8001, KvEventPorts(5557))
    assert pd.pods is not None and pd.pods.labels == (("role", "decode"),)
    pool = pd.prefill_pool()
    assert (pool.pods, pool.prefill, pool.migration, pool.pool) == (
        pd.prefill, None, None, "prefill")  # fmt: skip
    assert (pd.pool_key, pool.pool_key, pool.key) == ("a/pd", "a/pd#prefill", "a/pd")
    assert models.by_key["a/plain"].prefill is None
    with pytest.raises(ValueError, match="entry 'a/b': disaggregation needs pods"):
        parse({"a/b": {"host": "h", "disaggregation": {"prefill": prefill}}})
    with pytest.raises(ValueError, match="entry 'a/b': disaggregation.prefill.selector"):
        parse({"a/b": {"host": "h", "pods": pods,
                       "disaggregation": {"prefill": {"namespace": "a", "selector": {}}}}})  # fmt: skip


def test_the_command_line_and_environment(monkeypatch):
    s = parse_router_settings(["--models-file", "/etc/m.json", "--port", "9000"])
    assert (str(s.models_file), s.port, s.ready_poll_seconds) == ("/etc/m.json", 9000, 0.5)
    chart = parse_router_settings(["--models-file=/etc/sluice/activator/models.json"])
    assert (str(chart.models_file), chart.port) == ("/etc/sluice/activator/models.json", 8000)
    monkeypatch.setenv("SLUICE_ACTIVATOR_READY_POLL_SECONDS", "0.25")
    assert parse_router_settings(["--models-file", "m"]).ready_poll_seconds == 0.25
    with pytest.raises(ValueError, match="models_file"):
        parse_router_settings([])
    help_text = "".join(build_parser(RouterSettings).format_help().split())
    for name, info in RouterSettings.model_fields.items():
        assert info.description and "".join(info.description.split()) in help_text, name


def test_sluice_server_router_is_the_entry_point_also_as_activator(tmp_path, capsys):
    from sluice_server.__main__ import main

    for mode in ("router", "activator"):
        assert main([mode, "--models-file", str(tmp_path / "m"), "--port", "-1"]) == 2
        assert "--port: Input should be greater than or equal to 0" in capsys.readouterr().err


def test_hop_by_hop_headers_stay_behind():
    from sluice_server.router.proxy import forward_headers

    scope = {"headers": [(b"host", b"chat.team-a"), (b"connection", b"keep-alive, x-hop"),
                         (b"x-hop", b"1"), (b"keep-alive", b"timeout=5"), (b"te", b"trailers"),
                         (b"authorization", b"Bearer k"), (b"content-length", b"2"),
                         (b"x-sluice-model", b"team-a/chat"), (b"x-sluice-router", b"forged")]}  # fmt: skip
    # the router's own mark replaces a client's (the pod answers the router alone)
    assert forward_headers(scope) == [(b"authorization", b"Bearer k"),
                                      (b"x-sluice-model", b"team-a/chat"),
                                      (b"x-sluice-router", b"1")]  # fmt: skip


def test_an_entry_with_pods_names_their_namespace_selector_and_port():
    models = parse({"team-a/chat": {"host": "chat.team-a.svc.cluster.local", "pods": {
        "namespace": "team-a", "selector": {"b": "2", "a": "1"}, "port": 8001}}})  # fmt: skip
    pods = models.by_key["team-a/chat"].pods
    assert pods is not None and (pods.namespace, pods.port) == ("team-a", 8001)
    assert pods.label_selector == "a=1,b=2"
    assert parse(FILE).by_key["team-a/chat"].pods is None  # scale to zero only: the Service
    assert pods.kv_events is None  # no `kvEvents`: the pods publish none
    for bad in ({"namespace": "team-a", "selector": {}}, {"selector": {"a": "1"}},
                {"namespace": "n", "selector": {"a": "1"}, "kvEvents": {"port": 0}}):  # fmt: skip
        with pytest.raises(ValueError, match="pods"):
            parse({"a/b": {"host": "h", "pods": bad}})


def test_balance_is_read_least_loaded_by_default_and_an_unknown_one_named():
    pods = {"namespace": "n", "selector": {"a": "1"}}
    got = parse({"n/m": {"host": "h", "pods": pods, "balance": "round-robin"}})
    assert got.by_key["n/m"].balance == "round-robin"
    assert parse({"n/m": {"host": "h", "pods": pods}}).by_key["n/m"].balance == "least-loaded"
    with pytest.raises(ValueError, match="entry 'n/m': balance"):
        parse({"n/m": {"host": "h", "pods": pods, "balance": "random"}})


def test_kv_events_ports_are_read_and_unknown_fields_ignored():
    from sluice_server.router.models import KvEventPorts

    pods = {"namespace": "n", "selector": {"a": "1"}, "future": 1,
            "kvEvents": {"port": 5557, "replayPort": 5558, "topic": "kv"}}  # fmt: skip
    got = parse({"n/m": {"host": "h", "pods": pods}}).by_key["n/m"].pods
    assert got is not None and got.kv_events == KvEventPorts(5557, 5558)
    pods["kvEvents"] = {"port": 5557}
    got = parse({"n/m": {"host": "h", "pods": pods}}).by_key["n/m"].pods
    assert got is not None and got.kv_events == KvEventPorts(5557, None)


def test_a_pod_is_a_candidate_while_ready_with_an_ip_and_not_deleted():
    from sluice_server.router.pods import parse_pod

    def pod(ready="True", ip="10.0.0.7", deleting=False, restarts=0, cid="c://1", uid="u1"):
        meta = {"name": "p", "uid": uid}
        if deleting:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return parse_pod({"metadata": meta, "status": {
            "podIP": ip, "conditions": [{"type": "Ready", "status": ready}],
            "containerStatuses": [{"restartCount": restarts, "containerID": cid}]}})  # fmt: skip

    assert pod().candidate
    assert not pod(ready="False").candidate and not pod(ip="").candidate
    assert not pod(deleting=True).candidate
    assert not pod().restarted_since(pod())
    assert not pod().restarted_since(pod(cid=""))  # the first start is no restart
    assert pod(restarts=1).restarted_since(pod())
    assert pod(cid="c://2").restarted_since(pod())
    assert pod(uid="u2").restarted_since(pod())  # the same name, another pod


def test_a_pin_is_valid_only_for_its_model_pod_key_and_time():
    from sluice_server.router.pin import Pins

    pins = Pins(b"k" * 32, 60)
    value = pins.sign("team-a/chat", "chat-7d9f.x", now=1000)  # a dot in the name
    assert pins.verify(value, "team-a/chat", now=1059) == "chat-7d9f.x"
    assert pins.verify(value, "team-a/chat", now=1060) is None  # expired
    assert pins.verify(value, "team-a/code", now=1000) is None
    assert Pins(b"j" * 32, 60).verify(value, "team-a/chat", now=1000) is None
    for bad in ("", "x", "a.b", "a.b.c", value + "0", value.replace("1060", "1061")):
        assert pins.verify(bad, "team-a/chat", now=1000) is None, bad
    cookie = [(b"cookie", b"a=1; sluice-pin=" + pins.sign("m/n", "p").encode())]
    assert pins.pinned(cookie, "m/n") == "p" and pins.pinned(cookie, "m/o") is None
    assert pins.pinned([(b"cookie", b'sluice-pin="broken')], "m/n") is None
    with pytest.raises(ValueError, match="32 bytes"):
        Pins(b"short", 60)
