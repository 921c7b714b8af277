"""Live pods under the control plane: streams in flight through rollouts, scale-down, pod
deletion, node loss, and resumes pinned by the ingress's affinity cookie.

Each test brings its own tainted live node agent(s) (conftest `live_nodes`: every pod runs
under bubblewrap as its spec says) and shares the session's ingress (nginx configured from
the Ingress objects and the Ready pods). The models run the simulator engine: these tests
are about the pod lifecycle, not the engine (test_live_engine.py runs the real one).

Verdicts come from how each stream ended (traffic.py): the client's final event and
`[DONE]`, cross-checked with the access log of the server that served it
(`outcome=finished`), and from the exit code the node agent recorded for the old pod: no
read speed, no client timing.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from e2e_harness.endpoints import ready_endpoints
from e2e_harness.kube import eventually
from e2e_harness.traffic import Traffic, server_outcomes, verdict
from kubernetes import client

from .conftest import TIMINGS
from .live_helpers import (
    LONG_TOKENS,
    STREAM_TIMEOUT,
    drained_streams,
    live_pods,
    pod_ready,
    ready_model,
    routed,
    served_by,
    sim_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("footprint")]


def _traffic(url: str, node, **kw) -> Traffic:
    return Traffic(url, node.workdir, long_tokens=LONG_TOKENS, **kw).start()


# --- rollout under load ---------------------------------------------------------------
def _rollout_under_load(models, namespace, live_nodes, ingress, rollout=None) -> dict:
    (node,), placement = live_nodes(1)
    extra = {"rollout": rollout} if rollout else {}
    models.create(sim_model(namespace, "roll", placement, **extra))
    ready_model(models, namespace, "roll")
    url = routed(ingress, models.core, namespace, "roll", 1)
    (old,) = [p.metadata.name for p in live_pods(models, namespace, "roll")]
    traffic = _traffic(url, node, long=20, rate=4)
    try:
        traffic.wait_long_started()
        models.patch(namespace, "roll", {"spec": {"podAnnotations": {"e2e.sluice.dev/rev": "2"}}})

        def rolled():
            pods = live_pods(models, namespace, "roll")
            gone = old not in {p.metadata.name for p in models.pods(namespace, "roll")}
            return gone and len(pods) == 1 and pod_ready(pods[0]) and pods[0].metadata.name

        new = eventually(rolled, timeout=STREAM_TIMEOUT + 90, interval=0.5, message="the rollout")
        outcomes = traffic.finish()
    finally:
        traffic.process.stop()
    v = verdict(outcomes, server_outcomes(node.log_dir))
    v["old_pod_exits"] = [(e["code"], e["why"]) for e in node.exits if e["pod"] == old]
    v["old_pod_draining_streams"] = drained_streams(node, namespace, old)
    v["served_by_new_pod"] = served_by(node, namespace, new)
    ready_model(models, namespace, "roll")
    return v


def test_rollout_under_load_cuts_no_stream_and_fails_no_request(
    operator, models, namespace, live_nodes, ingress
):
    """Default surge 1 / unavailable 0: the new pod is Ready before the old one is told to
    stop; the old pod (preStop, then SIGTERM) drains all 20 long streams and exits 0."""
    v = _rollout_under_load(models, namespace, live_nodes, ingress)
    TIMINGS["live rollout, default surge: streams cut / new requests failed"] = (
        f"{v['long_cut']} of {v['long']} / {v['short_failed']} of {v['short']}")  # fmt: skip
    assert v["long"] == 20 and v["short"] > 0, v
    assert (v["long_cut"], v["short_failed"], v["not_finished_in_server_log"]) == (0, 0, 0), (
        v["failures"])  # fmt: skip
    assert v["old_pod_draining_streams"] == 20, v  # all 20 were in flight at SIGTERM
    assert v["old_pod_exits"] == [(0, "Completed")], v
    assert v["served_by_new_pod"] > 0, v  # new arrivals moved to the new pod


def test_in_place_rollout_under_load_fails_new_requests(
    operator, models, namespace, live_nodes, ingress
):
    """maxSurge 0 / maxUnavailable 1, what the default protects against (and the negative
    control of the verdict): the old pod drains its streams, but until the new pod is
    Ready nothing serves new requests, and the ingress answers them 503."""
    v = _rollout_under_load(models, namespace, live_nodes, ingress,
                            rollout={"maxSurge": 0, "maxUnavailable": 1})  # fmt: skip
    TIMINGS["live rollout, maxSurge 0: streams cut / new requests failed"] = (
        f"{v['long_cut']} of {v['long']} / {v['short_failed']} of {v['short']}")  # fmt: skip
    assert v["long_cut"] == 0, v
    assert v["short_failed"] > 0, v
    assert v["old_pod_exits"] == [(0, "Completed")], v


# --- scale-down and pod deletion under load -------------------------------------------
def _two_replicas_under_load(models, namespace, live_nodes, ingress, act) -> dict:
    (node,), placement = live_nodes(1)
    models.create(sim_model(namespace, "pair", placement, replicas=2))
    ready_model(models, namespace, "pair")
    url = routed(ingress, models.core, namespace, "pair", 2)
    before = {p.metadata.name for p in live_pods(models, namespace, "pair")}
    traffic = _traffic(url, node, long=10, rate=2)
    try:
        traffic.wait_long_started()
        gone = act(before)
        eventually(lambda: gone not in {p.metadata.name for p in models.pods(namespace, "pair")},
                   timeout=STREAM_TIMEOUT + 60, interval=0.5, message=f"{gone} to go")  # fmt: skip
        outcomes = traffic.finish()
    finally:
        traffic.process.stop()
    v = verdict(outcomes, server_outcomes(node.log_dir))
    v["gone_pod_exits"] = [(e["code"], e["why"]) for e in node.exits if e["pod"] == gone]
    v["gone_pod_draining_streams"] = drained_streams(node, namespace, gone)
    return v


def test_scale_down_under_load_completes_in_flight_streams(
    operator, models, namespace, live_nodes, ingress
):
    def scale_down(before: set[str]) -> str:
        models.patch(namespace, "pair", {"spec": {"replicas": 1}})
        return eventually(lambda: next((p.metadata.name for p in models.pods(namespace, "pair")
                                        if p.metadata.deletion_timestamp), None),
                          timeout=30, message="the scale-down to pick a pod")  # fmt: skip

    v = _two_replicas_under_load(models, namespace, live_nodes, ingress, scale_down)
    TIMINGS["live scale-down 2 -> 1: streams cut / new requests failed"] = (
        f"{v['long_cut']} of {v['long']} / {v['short_failed']} of {v['short']}")  # fmt: skip
    assert (v["long_cut"], v["short_failed"], v["not_finished_in_server_log"]) == (0, 0, 0), (
        v["failures"])  # fmt: skip
    assert v["gone_pod_draining_streams"] and v["gone_pod_draining_streams"] > 0, v
    assert v["gone_pod_exits"] == [(0, "Completed")], v


def test_pod_deletion_under_load_completes_in_flight_streams(
    operator, models, namespace, live_nodes, ingress
):
    def delete_one(before: set[str]) -> str:
        victim = sorted(before)[0]
        models.core.delete_namespaced_pod(victim, namespace)
        return victim

    v = _two_replicas_under_load(models, namespace, live_nodes, ingress, delete_one)
    TIMINGS["live pod deletion: streams cut / new requests failed"] = (
        f"{v['long_cut']} of {v['long']} / {v['short_failed']} of {v['short']}")  # fmt: skip
    assert (v["long_cut"], v["short_failed"], v["not_finished_in_server_log"]) == (0, 0, 0), (
        v["failures"])  # fmt: skip
    assert v["gone_pod_draining_streams"] and v["gone_pod_draining_streams"] > 0, v
    assert v["gone_pod_exits"] == [(0, "Completed")], v
    ready_model(models, namespace, "pair")  # the ReplicaSet's replacement serves


# --- resume across replicas ------------------------------------------------------------
def _first_events(http: httpx.Client, url: str, n: int, **kw) -> tuple[str, httpx.Cookies, str]:
    """Start a 30 s token stream (a resume after its end gets 204), read `n` token events,
    drop the connection; (last event id,
    the cookies the ingress set, the request id)."""
    body = {"messages": [{"role": "user", "content": "resume me"}], "max_tokens": 200}
    last = ""
    with http.stream("POST", f"{url}/v1/stream", json=body, **kw) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-request-id"]
        seen = 0
        for line in r.iter_lines():
            if line.startswith("id:"):
                last = line[3:].strip()
            elif line.startswith("data: {") and json.loads(line[6:]).get("finished") is False:
                seen += 1
                if seen == n:
                    break
    return last, r.cookies, rid


def _resume(url: str, last: str, cookie: str | None) -> tuple[int, list[str]]:
    headers = {"Last-Event-ID": last}
    if cookie:
        headers["Cookie"] = cookie
    lines: list[str] = []
    with httpx.stream("GET", f"{url}/v1/stream", headers=headers, timeout=60) as r:
        if r.status_code == 200:
            lines = [x for x in r.iter_lines() if x.startswith(("id:", "data:"))]
        return r.status_code, lines


def test_dropped_stream_resumes_on_its_pod_through_the_affinity_cookie(
    operator, models, namespace, live_nodes, ingress
):
    (node,), placement = live_nodes(1)
    body = sim_model(namespace, "res", placement, replicas=2,
                     streaming={"resume": {"graceSeconds": 60}})  # fmt: skip
    models.create(body)
    ready_model(models, namespace, "res")
    url = routed(ingress, models.core, namespace, "res", 2)
    endpoints = {e.address for e in ready_endpoints(models.core, namespace, "res")}
    with httpx.Client(timeout=60) as http:
        last, cookies, rid = _first_events(http, url, 5)
    pinned = cookies.get("sluice-affinity")
    assert pinned in endpoints, (pinned, endpoints)
    # Negative control: the same resume pinned to the other pod is refused there.
    (other,) = endpoints - {pinned}
    status, _ = _resume(url, last, f"sluice-affinity={other}")
    assert 400 <= status < 500, status
    status, lines = _resume(url, last, f"sluice-affinity={pinned}")
    assert status == 200
    stream_id, index = last.rsplit(":", 1)
    ids = [x[3:].strip() for x in lines if x.startswith("id:")]
    assert ids and ids[0] == f"{stream_id}:{int(index) + 1}", ids[:3]  # right after the drop
    data = [x for x in lines if x.startswith("data:")]
    assert data[-1] == "data: [DONE]" and '"finish_reason": "length"' in data[-2], data[-3:]
    TIMINGS["live resume: events after the drop, on the pinned pod"] = len(ids)
    assert rid


# --- node loss ---------------------------------------------------------------------------
def test_node_loss_evicts_and_reschedules_and_the_model_is_ready_again(
    operator, models, namespace, live_nodes, ingress
):
    agents, placement = live_nodes(2)
    short = [{"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute",
              "tolerationSeconds": 2} for t in ("unreachable", "not-ready")]  # fmt: skip
    placement = {**placement, "tolerations": placement["tolerations"] + short}
    models.create(sim_model(namespace, "lost", placement))
    ready_model(models, namespace, "lost")
    (pod,) = live_pods(models, namespace, "lost")
    doomed = next(a for a in agents if a.name == pod.spec.node_name)
    survivor = next(a for a in agents if a is not doomed)
    t0 = time.monotonic()
    doomed.crash()
    core = models.core

    def not_ready():
        conds = core.read_node(doomed.name).status.conditions
        return any(c.type == "Ready" and c.status != "True" for c in conds)

    eventually(not_ready, timeout=120, interval=1, message=f"{doomed.name} NotReady")
    t_not_ready = time.monotonic() - t0

    def replaced():
        pods = live_pods(models, namespace, "lost")
        return [p for p in pods if p.spec.node_name == survivor.name and pod_ready(p)]

    eventually(replaced, timeout=120, interval=1, message="a replacement Ready on the other node")
    t_replaced = time.monotonic() - t0
    try:  # the taint manager's eviction: deleted, and no kubelet left to confirm it
        evicted = core.read_namespaced_pod(pod.metadata.name, namespace)
        assert evicted.metadata.deletion_timestamp is not None
    except client.ApiException as e:
        assert e.status == 404
    ready_model(models, namespace, "lost")
    url = routed(ingress, core, namespace, "lost", 1)
    got = httpx.post(f"{url}/v1/stream", json={"messages": [{"role": "user", "content": "x"}],
                                               "max_tokens": 3}, timeout=30)  # fmt: skip
    assert got.status_code == 200 and "[DONE]" in got.text
    TIMINGS["live node loss: NotReady / replacement Ready after (s)"] = (
        f"{t_not_ready:.0f} / {t_replaced:.0f}")  # fmt: skip


# --- an image the agent cannot run -----------------------------------------------------
def test_unknown_image_is_a_clear_status_not_a_crash(operator, models, namespace, live_nodes):
    (node,), placement = live_nodes(1)
    body = sim_model(namespace, "img", placement)
    body["spec"]["image"] = "registry.example/not-sluice:1"
    models.create(body)

    def stuck():
        st = models.get(namespace, "img").get("status") or {}
        return "ErrImagePull" in (st.get("message") or "") and st

    st = eventually(stuck, timeout=60, interval=0.5, message="status to name ErrImagePull")
    assert "has no local mapping" in st["message"], st["message"]
    assert not node.exits  # nothing ran, nothing crashed


# --- a Secret rotated under a running pod ------------------------------------------------
def test_rotated_key_secret_reaches_the_running_pod_without_a_restart(
    operator, models, namespace, live_nodes, ingress
):
    """The agent swaps the Secret volume's `..data` as the kubelet does; the server's key
    file reload picks it up: the new key works, the old one is refused, same process."""
    (node,), placement = live_nodes(1)
    old, new = "e2e-old-key-0123456789abcdef", "e2e-new-key-0123456789abcdef"
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name="keys"),
                             string_data={"keys": old + "\n"})  # fmt: skip
    models.core.create_namespaced_secret(namespace, secret)
    models.create(sim_model(namespace, "auth", placement,
                            auth={"apiKeySecretRef": {"name": "keys", "key": "keys"}}))  # fmt: skip
    ready_model(models, namespace, "auth")
    url = routed(ingress, models.core, namespace, "auth", 1,
                 headers={"Authorization": f"Bearer {old}"})  # fmt: skip
    (pod,) = live_pods(models, namespace, "auth")
    models.core.patch_namespaced_secret("keys", namespace, {"stringData": {"keys": new + "\n"}})

    def status(key: str) -> int:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code  # fmt: skip

    eventually(lambda: status(new) == 200 and status(old) == 401, timeout=60, interval=0.5,
               message="the rotated key to be served")  # fmt: skip
    runtime = node.pod(pod.metadata.name, namespace)
    assert [p.updates for p in runtime.projections] == [1]
    after = models.core.read_namespaced_pod(pod.metadata.name, namespace)
    assert after.status.container_statuses[0].restart_count == 0
    assert not node.exits
