"""Scale to zero and back with the real activator, on live pods, through the ingress.

The chart's activator Deployment and Service run as rendered (one replica, on the live
node, plus `hostAliases` naming the model Service's cluster name: there is no cluster DNS
here, so the node agent writes the pod's /etc/hosts and a `ServiceProxy` stands in for
kube-proxy at that address). The operator writes its models ConfigMap, the activator pod
reads it through the mounted volume, the Ingress switches to the model's ExternalName
Service `<name>-activator` with upstream-vhost, and the harness ingress resolves that
name to the activator pod and sends the model Service's name as Host, as ingress-nginx with
the cluster DNS would. The chart's activator container gets one argument more,
`--host=0.0.0.0` (its default said out loud), which the node agent binds to the pod's own
address: the pods share the host's network.

What it shows: the idle model goes to zero; 20 concurrent clients (token SSE, OpenAI
streams through the official SDK, WebSocket, non-streamed chat) arrive through the ingress
while nothing runs; the activator holds them, the operator scales the model to 1 from the
activator's held gauge, and every client gets its whole answer; each held stream heard at
least one keep-alive per keep-alive interval it was held (the activator's own hold time).
Once the route is back on the model's Service, requests through the ingress no longer
reach the activator (its request counter stays put). A second model whose image cannot be
pulled never gets a Ready replica: a held client that leaves is dropped (held gauge back to
0, outcome `disconnected`), and a request held past its holdTimeoutSeconds gets 503
`model_starting` with Retry-After. The TIMINGS output has the first request against the
new pod's creation and Ready transition (API server timestamps), the clients' time to
first token, the activator's logged hold times and the server's access-log TTFT.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import time
from datetime import datetime

import httpx
import openai
import pytest
from e2e_harness.endpoints import Endpoint
from e2e_harness.kube import eventually
from e2e_harness.service_proxy import ServiceProxy
from kubernetes import client
from websockets.asyncio.client import connect

from .conftest import OPERATOR_NAMESPACE, TIMINGS
from .live_helpers import live_pods, ready_model, sim_model

pytestmark = [pytest.mark.slow]

IDLE_SECONDS = 30
TOKENS = 16
CLIENTS = 20  # 5 of each kind
KINDS = ("sse", "openai", "ws", "chat")
HOLD_TIMEOUT = 10  # the model that never starts
KEEPALIVE_SECONDS = 10  # what the operator writes into models.json


def _ts(value) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value)


def _metrics(ip: str) -> dict[str, float]:
    text = httpx.get(f"http://{ip}:8000/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("sluice_activator_") and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _count(metrics: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metrics.items()
               if k.startswith(name + "{") and all(w in k for w in want))  # fmt: skip


def _activator(live_router, placement: dict, aliases: list[dict]) -> Endpoint:
    """The chart's activator (router) on a live node (live_helpers.LiveRouter), the cluster
    names the test resolves given as host aliases: its endpoint once its pod is Ready, with
    the ServiceAccount volume the admission plugin added (mounted by the node agent: its
    token as the chart asks for it)."""
    (ep,) = live_router.start(placement, replicas=1, hostAliases=aliases)
    pod = live_router.core.read_namespaced_pod(ep.pod, OPERATOR_NAMESPACE)
    assert any(v.name.startswith("kube-api-access-") for v in pod.spec.volumes), pod.spec.volumes
    return ep


async def _client(kind: str, url: str, i: int) -> dict:
    """One request of `kind`; what it got and when (time.time())."""
    t0 = time.time()
    rec: dict = {"kind": kind, "sent": t0, "first": None, "tokens": 0, "reason": None,
                 "keepalives": [], "error": None}  # fmt: skip
    messages = [{"role": "user", "content": f"hello {i}"}]
    try:
        if kind == "sse":
            async with httpx.AsyncClient(timeout=httpx.Timeout(180)) as http:
                body = {"messages": messages, "max_tokens": TOKENS}
                async with http.stream("POST", f"{url}/v1/stream", json=body) as r:
                    rec["status"] = r.status_code
                    text = []
                    async for line in r.aiter_lines():
                        if line.startswith(":") and rec["first"] is None:
                            rec["keepalives"].append(time.time())
                        elif line.startswith("data: {") and rec["first"] is None:
                            rec["first"] = time.time()
                        text.append(line)
                    rec["tokens"], rec["reason"], done = _sse("\n".join(text))
                    rec["done"] = done
        elif kind == "openai":
            sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=180,
                                     max_retries=0)  # fmt: skip
            stream = await sdk.chat.completions.create(
                model="sim", messages=messages, max_tokens=TOKENS, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
            async for chunk in stream:
                if chunk.choices and rec["first"] is None:
                    rec["first"] = time.time()
                for c in chunk.choices:
                    rec["reason"] = c.finish_reason or rec["reason"]
                if chunk.usage:
                    rec["tokens"] = chunk.usage.completion_tokens
            rec["status"], rec["done"] = 200, True
            await sdk.close()
        elif kind == "ws":
            ws_url = url.replace("http://", "ws://") + "/ws/stream"
            async with connect(ws_url, open_timeout=180, ping_interval=None) as ws:
                await ws.send(json.dumps({"id": f"w{i}", "messages": messages,
                                          "params": {"max_tokens": TOKENS}}))  # fmt: skip
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 180))
                    if frame.get("type") == "queued":  # the held generation's keep-alive
                        rec["keepalives"].append(time.time())
                    elif rec["first"] is None:
                        rec["first"] = time.time()
                    if frame.get("finished"):
                        rec["reason"] = frame.get("finish_reason")
                        rec["tokens"] = (frame.get("usage") or {}).get("completion_tokens")
                        break
                    if frame.get("error"):
                        rec["error"] = str(frame)[:200]
                        break
            rec["status"], rec["done"] = 200, True
        else:
            async with httpx.AsyncClient(timeout=httpx.Timeout(180)) as http:
                r = await http.post(f"{url}/v1/chat/completions", json={
                    "model": "sim", "messages": messages, "max_tokens": TOKENS})  # fmt: skip
                rec["status"], rec["first"] = r.status_code, time.time()
                if r.status_code == 200:
                    body = r.json()
                    rec["reason"] = body["choices"][0]["finish_reason"]
                    rec["tokens"] = body["usage"]["completion_tokens"]
                    rec["done"] = True
                else:
                    rec["error"] = r.text[:200]
    except Exception as e:  # every failure is a verdict, not a crash of the scenario
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["end"] = time.time()
    return rec


def _sse(text: str) -> tuple[int, str | None, bool]:
    n, reason = 0, None
    for line in text.splitlines():
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            if ev.get("finished"):
                reason = ev.get("finish_reason")
            if ev.get("usage"):
                n = ev["usage"].get("completion_tokens", n)
    return n, reason, "data: [DONE]" in text


async def _crowd(url: str) -> list[dict]:
    return list(await asyncio.gather(*(_client(KINDS[i % len(KINDS)], url, i)
                                       for i in range(CLIENTS))))  # fmt: skip


def test_held_requests_of_every_protocol_are_answered_when_the_model_comes_back(
    operator, models, namespace, live_nodes, live_router, ingress, admin, chart
):
    apps, net, core = (
        client.AppsV1Api(admin),
        client.NetworkingV1Api(admin),
        client.CoreV1Api(admin),
    )
    (node,), placement = live_nodes(1)
    name, never = "wake", "never"  # never: its image cannot be pulled, no pod starts
    fqdn = f"{name}.{namespace}.svc.cluster.local"
    proxies = [ServiceProxy(core, namespace, n, f"127.4.{random.randint(0, 250)}."
                            f"{random.randint(1, 250)}", 8000).start() for n in (name, never)]  # fmt: skip
    try:
        aliases = [{"ip": p.ip, "hostnames": [f"{p.service}.{namespace}.svc.cluster.local"]}
                   for p in proxies]  # fmt: skip
        ep = _activator(live_router, placement, aliases)
        act_ip, act_log = ep.ip, node.log_dir / f"{OPERATOR_NAMESPACE}.{ep.pod}.activator.log"
        for n, hold, extra in ((name, 120, {}), (never, HOLD_TIMEOUT, {
                "image": "registry.example/not-sluice:1",
                "ingress": {"enabled": True, "path": f"/{namespace}/{never}"}})):  # fmt: skip
            body = sim_model(namespace, n, placement, **extra)
            body["spec"]["autoscaling"] = {
                "minReplicas": 0, "maxReplicas": 1,
                "scaleToZero": {"idleSeconds": IDLE_SECONDS, "holdTimeoutSeconds": hold},
            }  # fmt: skip
            models.create(body)
        ready_model(models, namespace, name, timeout=120)
        for n in (name, never):
            eventually(lambda n=n: _count(_metrics(act_ip), "sluice_activator_models_known",
                                          namespace=namespace, model=n) == 1, timeout=60,
                       interval=0.5, message=f"the activator pod to know {n}")  # fmt: skip

        # The model that cannot start: a held client that leaves is dropped; one held past
        # holdTimeoutSeconds is told 503 model_starting with Retry-After.
        never_url = f"{ingress.url}/{namespace}/{never}"
        ingress_host, ingress_port = httpx.URL(ingress.url).host, httpx.URL(ingress.url).port
        eventually(lambda: (ingress.reloads and ingress.reloads[-1].endpoints.get(
            re.sub(r"[^A-Za-z0-9_]", "_", f"{namespace}_{never}-activator_8000"))
            == (f"{ep.address}",)), timeout=60, interval=0.25,
            message=f"the ingress to route {never} to the activator")  # fmt: skip
        left = _count(_metrics(act_ip), "sluice_activator_requests_total", namespace=namespace,
                      model=never, outcome="disconnected")  # fmt: skip
        # A raw socket: nothing is answered while held (not even headers), so the client
        # leaves by closing its connection mid-request.
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        with socket.create_connection((ingress_host, ingress_port), timeout=30) as sock:
            sock.sendall(f"POST /{namespace}/{never}/v1/stream HTTP/1.1\r\nHost: e2e\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                         f"\r\n{body}".encode())  # fmt: skip
            eventually(lambda: _count(_metrics(act_ip), "sluice_activator_held_requests",
                                      namespace=namespace, model=never) == 1, timeout=30,
                       interval=0.1, message="the stream held")  # fmt: skip
        eventually(lambda: _count(_metrics(act_ip), "sluice_activator_held_requests",
                                  namespace=namespace, model=never) == 0
                   and _count(_metrics(act_ip), "sluice_activator_requests_total",
                              namespace=namespace, model=never, outcome="disconnected")
                   == left + 1, timeout=30, interval=0.2,
                   message="the client that left dropped from the held count")  # fmt: skip
        r = httpx.post(f"{never_url}/v1/chat/completions", timeout=HOLD_TIMEOUT + 60, json={
            "model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # fmt: skip
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_starting", r.text
        assert int(r.headers["retry-after"]) >= 1, r.headers
        assert _count(_metrics(act_ip), "sluice_activator_requests_total", namespace=namespace,
                      model=never, outcome="timeout") == 1  # fmt: skip

        # Idle: to zero; the route names the activator and the ingress reaches its pod.
        eventually(lambda: apps.read_namespaced_deployment(name, namespace).spec.replicas == 0,
                 timeout=IDLE_SECONDS + 90, interval=1, message="the scale to zero")  # fmt: skip
        eventually(lambda: not live_pods(models, namespace, name), timeout=90, interval=1,
                 message="the pod to go")  # fmt: skip
        upstream = re.sub(r"[^A-Za-z0-9_]", "_", f"{namespace}_{name}-activator_8000")
        eventually(lambda: ingress.reloads and ingress.reloads[-1].endpoints.get(upstream)
                 == (f"{act_ip}:8000",), timeout=30, interval=0.25,
                 message="the ingress to route the model to the activator pod")  # fmt: skip
        ing = net.read_namespaced_ingress(name, namespace)
        assert ing.metadata.annotations["nginx.ingress.kubernetes.io/upstream-vhost"] == fqdn
        before = _metrics(act_ip)

        # 20 clients while nothing runs: all held, all answered.
        url = f"{ingress.url}/{namespace}"
        got = asyncio.run(_crowd(url))
        bad = [r for r in got if r["error"] or r.get("status") != 200 or not r.get("done")
               or r["tokens"] != TOKENS or r["reason"] != "length"]  # fmt: skip
        assert not bad, [{k: r.get(k) for k in ("kind", "status", "error", "tokens", "reason")}
                         for r in bad]  # fmt: skip
        after = _metrics(act_ip)
        forwarded = _count(after, "sluice_activator_requests_total", namespace=namespace,
                           model=name, outcome="forwarded") - _count(
            before, "sluice_activator_requests_total", namespace=namespace, model=name,
            outcome="forwarded")  # fmt: skip
        assert forwarded == CLIENTS, (before, after)
        # Keep-alives: each held stream heard at least one per interval it was held (the
        # activator's own hold time; a WebSocket also hears one at once).
        holds = [float(x) for x in re.findall(rf"{namespace}/{name} forwarded after ([0-9.]+) s",
                                              act_log.read_text())]  # fmt: skip
        assert len(holds) == CLIENTS, holds
        due = int(min(holds) // KEEPALIVE_SECONDS)
        for r in got:
            if r["kind"] in ("sse", "ws"):
                assert len(r["keepalives"]) >= due + (r["kind"] == "ws"), (r, due)
        assert _count(after, "sluice_activator_held_requests", namespace=namespace,
                      model=name) == 0  # fmt: skip

        (pod,) = live_pods(models, namespace, name)
        ready_at = next(_ts(c.last_transition_time) for c in pod.status.conditions
                        if c.type == "Ready")  # fmt: skip
        created = _ts(pod.metadata.creation_timestamp)
        sent = min(r["sent"] for r in got)
        firsts = sorted(r["first"] - r["sent"] for r in got)
        sse = [r for r in got if r["kind"] == "sse"]
        TIMINGS["scale to zero live: first request -> pod created / Ready (s)"] = (
            round(created - sent, 1), round(ready_at - sent, 1))  # fmt: skip
        TIMINGS["scale to zero live: held TTFT min / median / max (s)"] = (
            round(firsts[0], 1), round(firsts[len(firsts) // 2], 1), round(firsts[-1], 1))  # fmt: skip
        TIMINGS["scale to zero live: keep-alives per held token SSE stream"] = [
            len(r["keepalives"]) for r in sse]  # fmt: skip
        TIMINGS["scale to zero live: activator hold min / max (s)"] = (
            round(min(holds), 1), round(max(holds), 1))  # fmt: skip
        server_log = node.log_dir / f"{namespace}.{pod.metadata.name}.server.log"
        ttfts = [float(x) for x in re.findall(r"ttft_ms=([0-9.]+)", server_log.read_text())]
        TIMINGS["scale to zero live: server access log TTFT max (ms)"] = round(max(ttfts), 1)

        # Up: the route is back on the model's Service; the activator sees nothing more.
        eventually(lambda: ingress.reloads and not ingress.reloads[-1].endpoints.get(upstream),
                 timeout=60, interval=0.25, message="the route back to the model")  # fmt: skip
        still = _metrics(act_ip)
        for _ in range(5):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "sim", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200, r.text
        assert _count(_metrics(act_ip), "sluice_activator_requests_total", namespace=namespace,
                      model=name) == _count(still, "sluice_activator_requests_total",
                                            namespace=namespace, model=name)  # fmt: skip
    finally:
        for p in proxies:
            p.stop()
