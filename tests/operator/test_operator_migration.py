"""Streams that outlive their pod, the operator's side (builders/continuation.py,
continuationkey.py): the per-model key derived as the server derives it, the Secret the
operator writes (and never reads), the pods' mount and flag, the router's models-file entry,
condition StreamMigration, and the master key read from its file at every pass."""

from __future__ import annotations

import base64
import copy
import json
import logging
import subprocess
import sys

import pytest
from operator_helpers import Events, FakeCluster, body_of, minimal, with_status
from sluice_operator.builders.activator import activator_entry
from sluice_operator.builders.continuation import (
    continuation_key,
    desired_continuation_secret,
    migrates,
)
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.continuationkey import ContinuationKeyFile
from sluice_operator.models.resource import OperatorDefaults
from sluice_operator.reconcile import converge
from sluice_operator.scaletozero import ZeroContext
from sluice_operator.scaletozero_poller import ActivatorSettings, ScaleToZeroPoller
from sluice_operator.validation import SpecError, load_model
from sluice_server.core.auth.routerkey import key_refusal, model_key
from sluice_server.router.models import Migration, parse
from testkit.repo import ROOT
from testkit.wait import eventually

NOW = "2026-12-01T06:00:00Z"
HOST = "sluice-activator.sluice-system.svc.cluster.local"
MASTER = b"a-master-key-of-the-router-48-characters-long-xx"
KEYED = OperatorDefaults(continuation_key=MASTER)
ROUTER = {"router": {"enabled": True}}
SECRET = ("Secret", "default", "m-continuation-key")


def routed(**spec) -> dict:
    return body_of(minimal(routing=spec.pop("routing", ROUTER), **spec))


def container(model) -> dict:
    (c,) = desired_deployment(model)["spec"]["template"]["spec"]["containers"]
    return c


def conditions(cluster: FakeCluster) -> dict:
    return {c["type"]: c for c in cluster.stored_status[("default", "m")]["conditions"]}


# ---- the key: the server's derivation, in the operator's own image ----------------------


@pytest.mark.parametrize(
    "master,namespace,name",
    [
        (MASTER, "default", "m"),
        (MASTER + b"\n", "team-a", "chat"),  # a file's trailing newline is not the key
        (b"  short\t", "a", "b"),
        (b"x" * 200, "n" * 63, "m" * 63),
        ("kéy-ü".encode(), "ns", "model-1"),
    ],
)
def test_the_operator_derives_each_models_key_as_the_server_does(master, namespace, name):
    assert continuation_key(master, namespace, name) == model_key(master, namespace, name)
    assert len(continuation_key(master, namespace, name)) == 64  # hex of SHA-256


def test_keys_differ_per_model_and_per_master():
    """Negative control: a namespace's Secret must not open another model's pods."""
    keys = {
        continuation_key(MASTER, "a", "m"),
        continuation_key(MASTER, "b", "m"),
        continuation_key(MASTER, "a", "n"),
        continuation_key(b"another", "a", "m"),
    }
    assert len(keys) == 4


# ---- what a router model gets ------------------------------------------------------------


def test_a_router_models_secret_holds_the_key_its_pods_accept(tmp_path):
    model = load_model(routed(), defaults=KEYED)
    secret = desired_continuation_secret(model)
    assert secret is not None
    assert secret["metadata"]["name"] == "m-continuation-key"
    assert secret["metadata"]["namespace"] == "default"
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == "m"
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "sluice-operator"
    key = base64.b64decode(secret["data"]["key"])
    assert key == model_key(MASTER, "default", "m")
    # What the pod's server does with the mounted file: the router's derived key passes,
    # another model's is refused.
    mounted = tmp_path / "key"
    mounted.write_bytes(key)
    assert key_refusal(mounted, model_key(MASTER, "default", "m")) is None
    assert key_refusal(mounted, model_key(MASTER, "default", "other"))[0] == 403
    c = container(model)
    i = c["args"].index("--continuation-key-file")
    assert c["args"][i + 1] == "/etc/sluice/continuation/key"
    assert {"name": "continuation-key", "mountPath": "/etc/sluice/continuation",
            "readOnly": True} in c["volumeMounts"]  # fmt: skip


CASES = {
    "no router": (minimal(), KEYED, True),
    "migration off": (
        minimal(routing={"router": {"enabled": True, "migration": {"enabled": False}}}),
        KEYED,
        True,
    ),  # fmt: skip
    "no key": (minimal(routing=ROUTER), OperatorDefaults(), True),
    "the chart runs no router": (minimal(routing=ROUTER), KEYED, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_secret_no_mount_no_flag_unless_the_router_migrates_with_a_key(case):
    spec, defaults, router = CASES[case]
    model = load_model(body_of(spec), defaults=defaults)
    if not router:
        model = type(model)(**{**model.__dict__, "router_available": False})
    assert not migrates(model)
    assert desired_continuation_secret(model) is None
    c = container(model)
    assert "--continuation-key-file" not in c["args"]
    assert all(m["name"] != "continuation-key" for m in c["volumeMounts"])
    entry = activator_entry(model)
    assert entry is None or "migration" not in entry
    # Positive control: the router model with the key, on a running router, does migrate.
    assert migrates(load_model(routed(), defaults=KEYED))


# ---- the router's models file ------------------------------------------------------------


def test_the_models_file_entry_carries_migration_and_the_router_reads_it():
    body = routed(
        routing={"router": {"enabled": True, "migration": {"maxMigrations": 5, "stallSeconds": 45}}}
    )
    entry = activator_entry(load_model(body, defaults=KEYED))
    assert entry is not None
    assert entry["migration"] == {"maxMigrations": 5, "stallSeconds": 45}
    model = parse({"default/m": json.loads(json.dumps(entry))}).by_key["default/m"]
    assert model.migration == Migration(max_migrations=5, stall_seconds=45.0)
    # The defaults: 3 moves, 30 s.
    entry = activator_entry(load_model(routed(), defaults=KEYED))
    assert entry is not None and entry["migration"] == {"maxMigrations": 3, "stallSeconds": 30}
    # Without the key (or with migration off) no entry: the router continues nothing.
    plain = activator_entry(load_model(routed()))
    assert plain is not None and "migration" not in plain
    assert parse({"default/m": plain}).by_key["default/m"].migration is None


@pytest.mark.parametrize("migration", [{"maxMigrations": -1}, {"stallSeconds": 0}])
def test_the_routers_parser_refuses_a_bad_migration(migration):
    full = {"maxMigrations": 3, "stallSeconds": 30, **migration}
    with pytest.raises(ValueError, match=f"entry 'a/b': migration.{next(iter(migration))}"):
        parse({"a/b": {"host": "h", "migration": full}})


@pytest.mark.parametrize(
    "migration,message",
    [
        ({"maxMigrations": 11}, "less than or equal to 10"),
        ({"maxMigrations": -1}, "greater than or equal to 0"),
        ({"stallSeconds": 0.5}, "greater than or equal to 1"),
    ],
)
def test_the_spec_bounds_migration(migration, message):
    with pytest.raises(SpecError, match=message):
        load_model(routed(routing={"router": {"enabled": True, "migration": migration}}))


def test_the_poller_writes_migration_into_the_routers_models_file():
    cluster = FakeCluster()
    cluster.store(routed())
    defaults = [KEYED]
    poller = ScaleToZeroPoller(
        cluster,
        cluster.memory,
        ActivatorSettings("sluice-activator", "sluice-system", "x=y"),
        wake=lambda keys: None,
        page=lambda pod: None,
        defaults=lambda: defaults[0],
    )
    poller.run_once()

    def listed() -> dict:
        cm = cluster.objects[("ConfigMap", "sluice-system", "sluice-activator-models")]
        return json.loads(cm["data"]["models.json"])["default/m"]

    assert listed()["migration"] == {"maxMigrations": 3, "stallSeconds": 30}
    defaults[0] = OperatorDefaults()  # the operator lost its key: the next round says so
    poller.run_once()
    assert "migration" not in listed()


# ---- the rule: a stall longer than the heartbeat -----------------------------------------


@pytest.mark.parametrize(
    "spec,refused",
    [
        ({"routing": ROUTER}, False),  # 30 s over 15 s
        ({"routing": ROUTER, "streaming": {"heartbeatSeconds": 30}}, True),
        ({"routing": ROUTER, "streaming": {"heartbeatSeconds": 60}}, True),
        (
            {
                "routing": {"router": {"enabled": True, "migration": {"stallSeconds": 60.5}}},
                "streaming": {"heartbeatSeconds": 60},
            },
            False,
        ),
        ({"streaming": {"heartbeatSeconds": 60}}, False),  # no router: no stall
        (
            {
                "routing": {"router": {"enabled": True, "migration": {"enabled": False}}},
                "streaming": {"heartbeatSeconds": 60},
            },
            False,
        ),
    ],
)
def test_a_stall_not_longer_than_the_heartbeat_is_refused(spec, refused):
    if not refused:
        load_model(body_of(minimal(**spec)))
        return
    with pytest.raises(SpecError) as info:
        load_model(body_of(minimal(**spec)))
    message = str(info.value)
    assert "stallSeconds must be greater than streaming.heartbeatSeconds" in message
    heartbeat = spec["streaming"]["heartbeatSeconds"]
    assert f"got stallSeconds 30 and heartbeatSeconds {heartbeat}" in message
    assert "spec.routing.router.migration.stallSeconds" in message


# ---- the pass: written, never read; rotated; deleted ---------------------------------------


def test_a_pass_writes_the_secret_without_reading_it_and_once(tmp_path):
    cluster, events = FakeCluster(), Events()
    body = routed()
    cluster.store(body)
    converge(cluster, body, events, now=NOW, reads=cluster.memory, defaults=KEYED)
    secret = cluster.objects[SECRET]
    assert base64.b64decode(secret["data"]["key"]) == model_key(MASTER, "default", "m")
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("StreamingModel", "m", "uid-1")
    cond = conditions(cluster)["StreamMigration"]
    assert (cond["status"], cond["reason"]) == ("True", "Enabled")
    assert "Secret m-continuation-key" in cond["message"] and "at most 3 times" in cond["message"]
    # The apply comes before the Deployment whose pods mount it.
    applies = [kind for verb, kind in cluster.calls if verb == "apply"]
    assert applies.index("Secret") < applies.index("Deployment")
    # A settled model: the next pass writes no Secret; no pass ever reads one.
    before = len(cluster.calls)
    converge(cluster, with_status(body, cluster), events, now=NOW, reads=cluster.memory,
             defaults=KEYED)  # fmt: skip
    assert ("apply", "Secret") not in cluster.calls[before:]
    assert not [c for c in cluster.calls if c[1] == "Secret" and c[0] in ("get", "list")]
    # The master key rotated: the model's key is derived anew and applied, the pods' template
    # is untouched (they read the file at each continuation).
    deployment = copy.deepcopy(cluster.objects[("Deployment", "default", "m")]["spec"])
    rotated = OperatorDefaults(continuation_key=b"a-new-master")
    before = len(cluster.calls)
    converge(cluster, with_status(body, cluster), events, now=NOW, reads=cluster.memory,
             defaults=rotated)  # fmt: skip
    assert cluster.calls[before:].count(("apply", "Secret")) == 1
    assert base64.b64decode(cluster.objects[SECRET]["data"]["key"]) == model_key(
        b"a-new-master", "default", "m"
    )
    assert cluster.objects[("Deployment", "default", "m")]["spec"] == deployment


def test_turning_migration_off_deletes_the_secret_and_the_mount():
    cluster, events = FakeCluster(), Events()
    body = routed()
    cluster.store(body)
    converge(cluster, body, events, now=NOW, reads=cluster.memory, defaults=KEYED)
    assert SECRET in cluster.objects
    off = copy.deepcopy(with_status(body, cluster))
    off["spec"]["routing"] = {"router": {"enabled": True, "migration": {"enabled": False}}}
    off["metadata"]["generation"] = 2
    cluster.store(off)
    converge(cluster, off, events, now=NOW, reads=cluster.memory, defaults=KEYED)
    assert SECRET not in cluster.objects
    assert ("delete", "Secret") in cluster.calls
    assert "StreamMigration" not in conditions(cluster)
    c = cluster.objects[("Deployment", "default", "m")]["spec"]["template"]["spec"]
    assert "--continuation-key-file" not in c["containers"][0]["args"]
    # The next pass deletes nothing more (the status no longer says it migrated), and a
    # model that never migrated never sends a delete of a Secret (negative control).
    before = len(cluster.calls)
    converge(cluster, with_status(off, cluster), events, now=NOW, reads=cluster.memory,
             defaults=KEYED)  # fmt: skip
    assert ("delete", "Secret") not in cluster.calls[before:]
    other = FakeCluster()
    converge(other, body_of(minimal()), Events(), now=NOW, defaults=KEYED)
    assert not [c for c in other.calls if c[1] == "Secret"]


def test_without_the_key_a_router_model_says_why_its_streams_do_not_migrate():
    cluster, events = FakeCluster(), Events()
    converge(cluster, routed(), events, now=NOW)
    cond = conditions(cluster)["StreamMigration"]
    assert (cond["status"], cond["reason"]) == ("False", "NoContinuationKey")
    assert "--continuation-key-file" in cond["message"]
    assert "activator.continuationKey" in cond["message"]
    assert not [c for c in cluster.calls if c[1] == "Secret"]
    # The chart runs no router: nothing relays the streams.
    cluster = FakeCluster()
    converge(cluster, routed(), events, now=NOW, defaults=KEYED,
             zero=ZeroContext(activator_host=HOST, router=False))  # fmt: skip
    cond = conditions(cluster)["StreamMigration"]
    assert (cond["status"], cond["reason"]) == ("False", "RouterDisabled")
    assert not [c for c in cluster.calls if c[1] == "Secret"]
    # A model without the router has no such condition.
    cluster = FakeCluster()
    converge(cluster, body_of(minimal()), events, now=NOW, defaults=KEYED)
    assert "StreamMigration" not in conditions(cluster)


# ---- the master key's file ---------------------------------------------------------------


def test_the_key_file_is_read_at_every_call_and_its_troubles_logged_once(tmp_path, caplog):
    path = tmp_path / "master"
    keyfile = ContinuationKeyFile(path)
    caplog.set_level(logging.WARNING, "sluice_operator.continuationkey")
    assert keyfile.read() is None and keyfile.read() is None
    path.write_bytes(b"\n")
    assert keyfile.read() is None
    path.write_bytes(MASTER + b"\nsecond line\n")
    assert keyfile.read() == MASTER
    assert keyfile.defaults(OperatorDefaults(model_image="x")) == OperatorDefaults(
        model_image="x", continuation_key=MASTER
    )
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # missing, then empty: once each
    assert "cannot be read" in warnings[0] and "is empty" in warnings[1]
    assert all(MASTER.decode() not in w for w in warnings)
    # The key never shows in a repr (a logged model or its defaults).
    model = load_model(routed(), defaults=keyfile.defaults(OperatorDefaults()))
    assert MASTER.decode() not in repr(model)


def test_a_changed_key_wakes_the_resync(tmp_path):
    path = tmp_path / "master"
    path.write_bytes(MASTER)
    keyfile = ContinuationKeyFile(path)
    woken: list[int] = []
    keyfile.watch(lambda: woken.append(1), seconds=0.05)
    try:
        path.write_bytes(b"rotated")
        eventually(lambda: woken == [1], timeout=5)
        path.unlink()  # gone: a change too (no stream migrates from now on)
        eventually(lambda: woken == [1, 1], timeout=5)
    finally:
        keyfile.stop()


def test_the_passes_read_the_key_file_at_every_pass(tmp_path, monkeypatch):
    from operator_helpers import runtime_for

    monkeypatch.setattr("kopf.event", lambda *args, **kwargs: None)  # no kopf context here

    path = tmp_path / "master"
    path.write_bytes(MASTER)
    cluster = FakeCluster()
    cluster.store(routed())
    router = ActivatorSettings("sluice-activator", "sluice-system", "x=y")
    logger = logging.getLogger("test")
    # Negative control: an operator run without the flag writes no Secret.
    runtime_for(cluster, activator=router).passes.converge("default", "m", 0, logger)
    assert SECRET not in cluster.objects and ("Deployment", "default", "m") in cluster.objects
    runtime = runtime_for(cluster, continuation_key_file=path, activator=router)
    runtime.passes.converge("default", "m", 0, logger)
    first = base64.b64decode(cluster.objects[SECRET]["data"]["key"])
    assert first == model_key(MASTER, "default", "m")
    path.write_bytes(b"rotated")
    runtime.passes.converge("default", "m", 0, logger)
    assert base64.b64decode(cluster.objects[SECRET]["data"]["key"]) == model_key(
        b"rotated", "default", "m"
    )


# ---- render ------------------------------------------------------------------------------


def test_render_with_the_key_file_prints_the_secret(tmp_path):
    path = tmp_path / "master"
    path.write_bytes(MASTER + b"\n")
    sample = ROOT / "samples" / "router.yaml"

    def render(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "sluice_operator", "render", "-f", str(sample), *extra]
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    keyed = render("--continuation-key-file", str(path))
    assert keyed.returncode == 0, keyed.stderr
    key = model_key(MASTER, "models", "chat-routed")
    assert base64.b64encode(key).decode() in keyed.stdout
    assert "/etc/sluice/continuation/key" in keyed.stdout
    plain = render()
    assert plain.returncode == 0 and "continuation" not in plain.stdout
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    refused = render("--continuation-key-file", str(empty))
    assert refused.returncode == 2 and "holds no key" in refused.stderr


def test_an_operator_refused_secrets_converges_the_model_without_migration():
    """An operator upgraded without its chart's RBAC (403 on Secrets): the model's other
    children converge, its pods get no mount and no flag (they would never be given the
    key), the status and one Warning say why, and the pass is retried; once granted, the
    next pass writes the Secret."""
    from kubernetes.client.exceptions import ApiException
    from operator_helpers import AbsentKind

    cluster, events = AbsentKind("Secret", 403), Events()
    body = routed()
    with pytest.raises(ApiException):
        converge(cluster, body, events, now=NOW, defaults=KEYED)
    pod = cluster.objects[("Deployment", "default", "m")]["spec"]["template"]["spec"]
    assert "--continuation-key-file" not in pod["containers"][0]["args"]
    assert all(v["name"] != "continuation-key" for v in pod["volumes"])
    cond = conditions(cluster)["StreamMigration"]
    assert (cond["status"], cond["reason"]) == ("False", "Forbidden")
    assert "m-continuation-key" in cond["message"] and "chart" in cond["message"]
    assert [e[1] for e in events if e[0] == "Warning"] == ["ContinuationKeyForbidden"]
    # The retry says nothing new.
    events.clear()
    with pytest.raises(ApiException):
        converge(cluster, with_status(body, cluster), events, now=NOW, defaults=KEYED)
    assert not [e for e in events if e[0] == "Warning"]
    # Granted: the Secret, the mount and the flag.
    cluster.refuse = 0
    converge(cluster, with_status(body, cluster), events, now=NOW, defaults=KEYED)
    assert SECRET in cluster.objects
    assert conditions(cluster)["StreamMigration"]["reason"] == "Enabled"
    pod = cluster.objects[("Deployment", "default", "m")]["spec"]["template"]["spec"]
    assert "--continuation-key-file" in pod["containers"][0]["args"]
