"""The router's high availability, live: two router pods (the chart's activator Deployment
and pin-key Secret as rendered, two replicas on the live node) in front of a two-pod
simulator model with `spec.routing.router.enabled`.

Each router pod is reached directly at its own pod address (the node agent binds
`--host=0.0.0.0` to it), with the model Service's cluster name as Host, as the route sends
it. What they show:

- a token SSE stream started through router A, cut by its client after a few events and
  resumed with `Last-Event-ID` and A's `sluice-pin` cookie through router B, continues on
  the pod that holds it at the next event: the text before the cut plus the resumed text is
  the same prompt's uninterrupted answer (no token twice, none missing). The resume's query
  string is chosen so that the placement every router computes alike (load tie-break,
  `placement.tie_hash`) would send it to the other pod: the cookie, not chance, brings it
  back. Negative controls, the same request without the cookie and with a forged one:
  placed as any other, on the other pod, which answers 404 `stream_not_found`;
- router A killed with SIGKILL with streams in flight through it: every client of A has its
  connection closed within seconds (what each client recorded, against the kill), the
  streams through B finish whole, and the model pods abort every orphaned engine request
  (their access logs: `disconnected`; `sluice_active_streams` back to 0);
- router B deleted (SIGTERM) with streams in flight through it: it drains, every stream
  finishes whole, and it exits 0 (the node agent's record).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from e2e_harness.endpoints import Endpoint
from e2e_harness.kube import eventually
from sluice_server.router.pin import COOKIE
from sluice_server.router.placement import tie_hash

from .conftest import OPERATOR_NAMESPACE, TIMINGS
from .live_helpers import ROUTER, access_records, by_request, live_pods, ready_model, sim_model

pytestmark = [pytest.mark.slow]

CONTAINER = "activator"


def _routers(live_router, placement: dict) -> list[Endpoint]:
    """The chart's router at two replicas (its default is at least that) on the live node:
    its two pods' endpoints once both are Ready."""
    (dep,) = [d for d in live_router.chart.of_kind("Deployment")
              if d["metadata"]["name"] == ROUTER]  # fmt: skip
    assert dep["spec"]["replicas"] >= 2, dep["spec"]["replicas"]  # the chart's default
    # One live node: the anti-affinity is only preferred anyway.
    return live_router.start(placement, replicas=2, affinity=None)


def _metrics(address: str, prefix: str) -> dict[str, float]:
    text = httpx.get(f"http://{address}/metrics", timeout=5).text
    return {k: float(v) for line in text.splitlines() if line.startswith(prefix)
            for k, _, v in [line.rpartition(" ")]}  # fmt: skip


def _sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metrics.items()
               if k.split("{")[0] == name and all(w in k for w in want))  # fmt: skip


class Model:
    """The model as the router knows it: by Host, at each router pod's own address."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name
        self.host = f"{name}.{namespace}.svc.cluster.local"

    def url(self, router: Endpoint) -> str:
        return f"http://{router.address}"

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Host": self.host, **extra}


def _deploy(models, namespace: str, name: str, placement: dict, routers: list[Endpoint],
            **spec) -> tuple[Model, list[str]]:  # fmt: skip
    body = sim_model(namespace, name, placement, replicas=2,
                     routing={"router": {"enabled": True}}, **spec)  # fmt: skip
    models.create(body)
    ready_model(models, namespace, name)
    pods = sorted(p.metadata.name for p in live_pods(models, namespace, name))
    assert len(pods) == 2, pods
    m = Model(namespace, name)
    for r in routers:
        eventually(lambda r=r: _sum(_metrics(r.address, "sluice_activator_models_known"),
                                    "sluice_activator_models_known", namespace=namespace,
                                    model=name) == 1, timeout=60, interval=0.5,
                   retry_on=(AssertionError, httpx.HTTPError),
                   message=f"router {r.pod} to know {name}")  # fmt: skip
    return m, pods


def _sees_both(m: Model, router: Endpoint, node, pods: list[str]) -> None:
    """Short streams through `router` until both model pods have served one of them: the
    router's Pod watch has both as candidates."""
    seen: set[str] = set()
    i = 0

    def both() -> bool:
        nonlocal i
        i += 1
        r = httpx.post(f"{m.url(router)}/v1/stream", headers=m.headers(), timeout=30, json={
            "messages": [{"role": "user", "content": f"warm {router.pod} {i}"}],
            "max_tokens": 1})  # fmt: skip
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        for pod, _ in by_request(node, m.namespace, pods).get(rid, []):
            seen.add(pod)
        return seen == set(pods)

    eventually(both, timeout=60, interval=0.2, message=f"router {router.pod} to use both pods")


# --- 1. a resume through the other router replica ------------------------------------
PROMPT = [{"role": "user", "content": "resume me through the other router"}]
RESUME_TOKENS = 80  # 12 s at 150 ms per token
CUT_AFTER = 5


def _events(lines: list[str]) -> list[tuple[str, dict]]:
    """(id, data) of each token SSE event that has both."""
    out, last = [], None
    for line in lines:
        if line.startswith("id:"):
            last = line[3:].strip()
        elif line.startswith("data: {") and last is not None:
            out.append((last, json.loads(line[6:])))
            last = None
    return out


def _text(events: list[tuple[str, dict]]) -> str:
    return "".join(d.get("token", "") for _, d in events if d.get("finished") is False)


def _resume(m: Model, router: Endpoint, last: str, query: str, cookie: str | None):
    headers = m.headers(**{"Last-Event-ID": last})
    if cookie is not None:
        headers["Cookie"] = f"{COOKIE}={cookie}"
    with httpx.stream("GET", f"{m.url(router)}/v1/stream?{query}", headers=headers,
                      timeout=60) as r:  # fmt: skip
        lines = list(r.iter_lines())
        return r.status_code, lines


def test_stream_cut_at_one_router_resumes_on_its_pod_through_the_other(
    operator, models, namespace, live_nodes, live_router, footprint
):
    (node,), placement = live_nodes(1)
    a, b = _routers(live_router, placement)
    m, pods = _deploy(models, namespace, "ha", placement, [a, b],
                      streaming={"resume": {"graceSeconds": 60}})  # fmt: skip
    _sees_both(m, b, node, pods)

    # The same prompt uninterrupted, through A (B's in-flight counts stay untouched).
    reference: dict = {}

    def whole() -> None:
        with httpx.stream("POST", f"{m.url(a)}/v1/stream", headers=m.headers(), timeout=120,
                          json={"messages": PROMPT, "max_tokens": RESUME_TOKENS}) as r:  # fmt: skip
            reference["lines"] = list(r.iter_lines())

    ref = threading.Thread(target=whole, daemon=True)
    ref.start()

    # Started through A, cut by the client after a few events.
    first: list[str] = []
    with httpx.stream("POST", f"{m.url(a)}/v1/stream", headers=m.headers(), timeout=60,
                      json={"messages": PROMPT, "max_tokens": RESUME_TOKENS}) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        rid, pin = r.headers["x-request-id"], r.cookies[COOKIE]
        for line in r.iter_lines():
            first.append(line)
            if sum(1 for _, d in _events(first) if d.get("finished") is False) == CUT_AFTER:
                break
    before = _events(first)
    last = before[-1][0]
    assert last == f"{rid}:{CUT_AFTER - 1}", last
    holder = pin.rsplit(".", 2)[0]  # the cookie names the pod: <pod>.<expiry>.<mac>
    assert holder in pods, (pin, pods)
    (other,) = set(pods) - {holder}
    # A resume key the routers' tie-break places on the other pod when nothing pins it.
    query = next(q for q in (f"k={i}" for i in range(1000))
                 if tie_hash(f"/v1/stream?{q}".encode(), other)
                 > tie_hash(f"/v1/stream?{q}".encode(), holder))  # fmt: skip
    picks0 = _metrics(b.address, "sluice_router_picks")

    # Negative controls through B: no cookie, and a forged one naming the holder.
    forged = pin[:-8] + ("0" * 8 if not pin.endswith("0" * 8) else "1" * 8)
    refused = {}
    for what, cookie in (("no cookie", None), ("forged cookie", forged)):
        status, lines = _resume(m, b, last, query, cookie)
        refused[what] = (status, "".join(lines)[:300])
        assert status == 404 and "stream_not_found" in "".join(lines), refused
    # The resume through B with A's cookie: the holder, from the next event on.
    status, lines = _resume(m, b, last, query, pin)
    assert status == 200, (status, lines[:5])
    after = _events(lines)
    ids = [i for i, _ in after]
    assert ids[0] == f"{rid}:{CUT_AFTER}", ids[:3]
    assert ids == [f"{rid}:{n}" for n in range(CUT_AFTER, CUT_AFTER + len(ids))], ids
    final = after[-1][1]
    assert final.get("finished") is True and final["finish_reason"] == "length", final
    assert final["usage"]["completion_tokens"] == RESUME_TOKENS, final
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines, lines[-3:]

    ref.join(timeout=120)
    whole_text = _text(_events(reference["lines"]))
    assert _text(before) + _text(after) == whole_text, (_text(before), _text(after), whole_text)

    # What the system recorded: B picked the holder by the pin once (the controls by load);
    # the holder served the stream and its resume, the other pod refused the controls.
    picks = _metrics(b.address, "sluice_router_picks")
    by = {k: _sum(picks, "sluice_router_picks_total", namespace=namespace, model="ha", by=k)
          - _sum(picks0, "sluice_router_picks_total", namespace=namespace, model="ha", by=k)
          for k in ("pin", "load", "prefix")}  # fmt: skip
    assert by == {"pin": 1, "load": 2, "prefix": 0}, by
    recs = {p: access_records(node, namespace, p) for p in pods}
    mine = [(p, r["status"], r["outcome"]) for p in pods for r in recs[p] if r["request_id"] == rid]
    assert {p for p, *_ in mine} == {holder} and all(st == 200 for _, st, _ in mine), mine
    # The stream GETs (the routers also GET each pod's /internal/prefix-cache description).
    gets = sorted((p, r["status"]) for p in pods for r in recs[p]
                  if r["method"] == "GET" and r.get("path", "").startswith("/v1/stream"))  # fmt: skip
    assert gets == sorted([(other, 404), (other, 404), (holder, 200)]), gets
    server = {p: _metrics(f"{ip}:8000", "sluice_stream_resumes") for p, ip in
              ((p.metadata.name, p.status.pod_ip) for p in live_pods(models, namespace, "ha"))}  # fmt: skip
    assert {p: _sum(v, "sluice_stream_resumes_total") for p, v in server.items()} == {
        holder: 1, other: 0}, server  # fmt: skip
    TIMINGS["router HA: resume through the other router (events before / after the cut)"] = (
        f"{len(before)} / {len(after)}; refused without the pin: {refused}")  # fmt: skip


# --- 2. a router pod killed (SIGKILL) and one stopped (SIGTERM) mid-burst -------------
BURST_TOKENS = 200  # 30 s: far longer than the kill and its aftermath
DRAIN_TOKENS = 40  # 6 s


class Client(threading.Thread):
    """One token SSE stream through one router pod; what it got and when (time.time())."""

    def __init__(self, m: Model, router: Endpoint, i: int, tokens: int) -> None:
        super().__init__(daemon=True)
        self.m, self.router, self.i, self.tokens = m, router, i, tokens
        self.rid: str | None = None
        self.events: list[tuple[str, dict]] = []
        self.done = False
        self.error: str | None = None
        self.first = threading.Event()
        self.ended_at: float | None = None

    def run(self) -> None:
        lines: list[str] = []
        try:
            with httpx.stream("POST", f"{self.m.url(self.router)}/v1/stream",
                              headers=self.m.headers(), timeout=httpx.Timeout(120, connect=10),
                              json={"messages": [{"role": "user", "content": f"burst {self.i}"}],
                                    "max_tokens": self.tokens}) as r:  # fmt: skip
                self.rid = r.headers.get("x-request-id")
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {"):
                        self.first.set()
                    self.done = self.done or line == "data: [DONE]"
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            self.ended_at = time.time()
            self.events = _events(lines)
            self.first.set()

    @property
    def whole(self) -> bool:
        final = self.events[-1][1] if self.events else {}
        return (self.done and self.error is None and final.get("finish_reason") == "length"
                and final.get("usage", {}).get("completion_tokens") == self.tokens)  # fmt: skip


def _burst(m: Model, router: Endpoint, n: int, start: int, tokens: int) -> list[Client]:
    clients = [Client(m, router, start + i, tokens) for i in range(n)]
    for c in clients:
        c.start()
    for c in clients:
        assert c.first.wait(60) and c.error is None, (c.router.pod, c.error)
    return clients


def test_router_pod_killed_mid_burst_closes_its_clients_and_the_pods_abort_their_requests(
    operator, models, namespace, live_nodes, live_router, footprint
):
    (node,), placement = live_nodes(1)
    a, b = _routers(live_router, placement)
    m, pods = _deploy(models, namespace, "burst", placement, [a, b])  # no resume: aborts
    model_ips = {p.metadata.name: p.status.pod_ip for p in live_pods(models, namespace, "burst")}

    doomed, kept = _burst(m, a, 6, 0, BURST_TOKENS), _burst(m, b, 4, 100, BURST_TOKENS)
    rids = {c.rid for c in doomed + kept}
    assert None not in rids and len(rids) == 10, rids
    active = sum(_sum(_metrics(f"{ip}:8000", "sluice_active_streams"), "sluice_active_streams")
                 for ip in model_ips.values())  # fmt: skip
    assert active == 10, active
    runtime = node.pod(a.pod, OPERATOR_NAMESPACE)
    pid1 = runtime.container(CONTAINER).pid1()
    assert pid1 is not None
    killed_at = time.time()
    os.kill(pid1, signal.SIGKILL)

    for c in doomed:
        c.join(timeout=150)
    # Every client of A: its read ended, cut (no [DONE]), within seconds of the kill.
    late = {c.rid: (c.ended_at and round(c.ended_at - killed_at, 2), c.error, c.done)
            for c in doomed}  # fmt: skip
    assert all(not c.is_alive() and not c.done and c.ended_at is not None
               and c.ended_at - killed_at < 10 for c in doomed), late  # fmt: skip
    exits = eventually(lambda: [e for e in node.exits if e["pod"] == a.pod], timeout=30,
                       interval=0.2, message="router A's exit")  # fmt: skip
    assert [e["code"] for e in exits] == [137], exits  # the agent's record: killed by SIGKILL

    # The model pods abort every orphaned request: access log `disconnected`, short of the
    # whole answer, and no stream left generating once B's have finished.
    def aborted():
        served = by_request(node, namespace, pods)
        outcomes = {c.rid: [r["outcome"] for _, r in served.get(c.rid, [])] for c in doomed}
        assert all(o == ["disconnected"] for o in outcomes.values()), outcomes
        return served

    served = eventually(aborted, timeout=30, interval=0.5, message="the orphans aborted")
    for c in doomed:
        ((_, rec),) = served[c.rid]
        assert rec["completion_tokens"] < BURST_TOKENS, rec
    # The pods' own clock: each orphan's access-log line within seconds of the kill.
    aborted_after = [served[c.rid][0][1]["at"] - killed_at for c in doomed]
    assert max(aborted_after) < 10, aborted_after
    for c in kept:
        c.join(timeout=120)
    bad = [(c.rid, c.error, c.done, c.events[-1:]) for c in kept if not c.whole]
    assert not bad, bad  # B's streams finished whole
    served = by_request(node, namespace, pods)
    assert all([r["outcome"] for _, r in served[c.rid]] == ["finished"] for c in kept)
    for pod, ip in model_ips.items():
        got = _metrics(f"{ip}:8000", "sluice_")
        assert _sum(got, "sluice_active_streams") == 0, (pod, got)
    aborts = sum(_sum(_metrics(f"{ip}:8000", "sluice_aborts"), "sluice_aborts_total")
                 for ip in model_ips.values())  # fmt: skip
    assert aborts == len(doomed), aborts
    TIMINGS["router HA: SIGKILL -> clients' reads ended / pods logged the abort (s, max)"] = (
        round(max(c.ended_at - killed_at for c in doomed if c.ended_at), 2),
        round(max(aborted_after), 2))  # fmt: skip

    # SIGTERM: router B deleted (its grace period as the chart sets it) with streams in
    # flight through it; it drains them and exits 0.
    core = models.core
    draining = _burst(m, b, 4, 200, DRAIN_TOKENS)
    core.delete_namespaced_pod(b.pod, OPERATOR_NAMESPACE)
    for c in draining:
        c.join(timeout=120)
    bad = [(c.rid, c.error, c.done, c.events[-1:]) for c in draining if not c.whole]
    assert not bad, bad
    gone = eventually(lambda: [e for e in node.exits if e["pod"] == b.pod], timeout=90,
                      interval=0.5, message="router B's exit")  # fmt: skip
    assert [e["code"] for e in gone] == [0], gone
    assert all(e["time"] >= max(c.ended_at for c in draining) - 1 for e in gone), gone
    log = (node.log_dir / f"{OPERATOR_NAMESPACE}.{b.pod}.{CONTAINER}.log").read_text()
    assert "draining: 0 requests held" in log, log[-2000:]
    served = by_request(node, namespace, pods)
    assert all([r["outcome"] for _, r in served[c.rid]] == ["finished"] for c in draining)
