"""Disaggregated serving, live (docs/disaggregation.md): a StreamingModel with
`spec.disaggregation` under the control plane, its prefill and decode pools on a live node,
the chart's router (one pod) doing the two steps, requests e2e ingress -> router -> pods.

- Real engines: one prefill and one decode pod of the tiny model (vLLM's CPU build) with the
  shared-storage connector on a ReadWriteMany claim of the namespace (the node agent gives
  the claim one host folder, which both pods mount read-write). One stream at temperature 0
  on every protocol (OpenAI chat and completions, Responses, Anthropic Messages, the token
  stream, WebSocket), each with a prompt of its own: the decode pod's usage reports the
  prompt's full blocks as cached (loaded from what the prefill pod wrote, not computed: its
  own prefix cache never saw the prompt), its `sluice_kv_transfer_tokens_total` counts them
  in and the prefill pod's counts the prompts out, and the text equals a plain
  (non-disaggregated) pod's of the same model. Negative control: a prompt sent to the
  decode pod without the router (no prefill) reports 0 cached tokens. Status shows both
  pools Ready and the model Ready.
- Simulator pools, 2 prefill + 1 decode: a prefill pod SIGKILLed while prompts are in
  flight on it: every stream still ends whole, the router counts the broken prefills as
  `failed` and ran each of them again on the other prefill pod.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import uuid

import httpx
import pytest
from e2e_harness.kube import eventually, load_sample
from kubernetes import client

from .conftest import TIMINGS
from .live_helpers import (
    claim,
    live_pods,
    metric_sum,
    metrics_page,
    pod_ready,
    ready_model,
    rwx_claim,
    sim_model,
)

pytestmark = [pytest.mark.slow]

ROLE = "serving.sluice.dev/role"
START_TIMEOUT = 900  # an engine starts in 66-131 s on two idle cores; three share them here
WORDS = "river stone lamp forest cloud window garden bridge paper candle".split()
TOKENS = 24
STREAMS = 12  # two per protocol, through the killed prefill pod's peer
PROTOCOLS = ("chat", "completions", "responses", "messages", "stream", "websocket")


def _prompt() -> str:
    """About 330 tokens of the tiny model (more than two of the CPU build's 128-token
    blocks), new to every engine's cache."""
    return uuid.uuid4().hex + " " + " ".join(WORDS[i % 10] for i in range(75))


def _body(protocol: str, text: str, model: str) -> tuple[str, dict]:
    """The route and the body of one temperature-0 stream of TOKENS tokens."""
    messages = [{"role": "user", "content": text}]
    openai = {"model": model, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    params = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    return {
        "chat": ("/v1/chat/completions", {**openai, "messages": messages}),
        "completions": ("/v1/completions", {**openai, "prompt": text}),
        "responses": ("/v1/responses", {"model": model, "input": text, "temperature": 0,
                                        "max_output_tokens": TOKENS, "stream": True}),
        "messages": ("/v1/messages", {"model": model, "messages": messages, "temperature": 0,
                                      "max_tokens": TOKENS, "stream": True}),
        "stream": ("/v1/stream", {"model": model, "prompt": text, **params}),
        "websocket": ("/ws/stream", {"id": "g1", "model": model, "prompt": text,
                                     "params": params}),
    }[protocol]  # fmt: skip


def _read(protocol: str, objs: list[dict]) -> tuple[str, int | None, bool]:
    """(text, cached prompt tokens the usage reports, ended with its final event) of one
    stream's JSON events or frames."""
    text, cached, final = "", None, False
    for o in objs:
        kind = o.get("type")
        if protocol == "chat":
            text += "".join(
                (c.get("delta") or {}).get("content") or "" for c in o.get("choices", [])
            )
            final = final or any(c.get("finish_reason") for c in o.get("choices", []))
        elif protocol == "completions":
            text += "".join(c.get("text") or "" for c in o.get("choices", []))
            final = final or any(c.get("finish_reason") for c in o.get("choices", []))
        elif protocol == "responses":
            text += o.get("delta", "") if kind == "response.output_text.delta" else ""
            final = final or kind == "response.completed"
        elif protocol == "messages":
            text += (o.get("delta") or {}).get("text", "") if kind == "content_block_delta" else ""
            final = final or kind == "message_stop"
        elif o.get("finished"):
            final = True
        else:
            text += o.get("token", "")
        usage = o.get("usage") or (o.get("response") or {}).get("usage")
        if not usage or kind == "response.created":
            continue
        if "cache_read_input_tokens" in usage:
            cached = usage["cache_read_input_tokens"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        if details is not None:
            cached = details.get("cached_tokens")
    return text, cached, final


def _stream(base: str, protocol: str, text: str, model: str) -> tuple[str, int | None]:
    """One whole stream's (text, cached prompt tokens); fails unless it ended whole."""
    path, body = _body(protocol, text, model)
    if protocol == "websocket":
        from websockets.sync.client import connect

        frames: list[dict] = []
        with connect(base.replace("http://", "ws://") + path, open_timeout=60) as ws:
            ws.send(json.dumps(body))
            while not (frames and (frames[-1].get("finished") or "error" in frames[-1])):
                frames.append(json.loads(ws.recv(timeout=300)))
        got, cached, final = _read(protocol, frames)
        assert final and frames[-1].get("finish_reason") == "length", frames[-1]
        return got, cached
    r = httpx.post(f"{base}{path}", json=body, timeout=300)
    assert r.status_code == 200, (protocol, r.status_code, r.text[-500:])
    objs = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    got, cached, final = _read(protocol, objs)
    openai = protocol in ("chat", "completions")
    assert final and (not openai or "data: [DONE]" in r.text), (protocol, r.text[-500:])
    return got, cached


def _pool(models, namespace: str, name: str, role: str) -> list[client.V1Pod]:
    return [p for p in live_pods(models, namespace, name)
            if (p.metadata.labels or {}).get(ROLE) == role]  # fmt: skip


def _router_knows(router, namespace: str, name: str) -> None:
    eventually(lambda: metric_sum(metrics_page(router.address), "sluice_activator_models_known",
                            namespace=namespace, model=name) == 1, timeout=60, interval=0.5,
               retry_on=(AssertionError, httpx.HTTPError), message="the router to know it")  # fmt: skip


def _through_ingress(ingress, namespace: str) -> str:
    url = f"{ingress.url}/{namespace}"
    eventually(lambda: httpx.get(f"{url}/v1/models", timeout=5).status_code == 200,
               timeout=120, interval=0.5, retry_on=(httpx.HTTPError,),
               message="the model through ingress -> router")  # fmt: skip
    return url


def _pools_ready(models, namespace: str, name: str, prefill: int, decode: int) -> dict:
    status = models.get(namespace, name)["status"]
    pools = status.get("pools") or {}
    want = {"prefill": prefill, "decode": decode}
    for role, n in want.items():
        p = pools.get(role) or {}
        assert (p.get("replicas"), p.get("readyReplicas"), p.get("ready")) == (n, n, f"{n}/{n}"), (
            pools
        )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    each = f"(prefill {prefill}/{prefill}, decode {decode}/{decode})"
    assert status.get("phase") == "Ready" and each in status.get("message", ""), status
    return status


@pytest.mark.engine
def test_on_real_engine_pods_the_decode_pod_streams_from_the_prefill_pods_kv_cache(
    operator, models, namespace, live_nodes, live_router, ingress, admin, footprint
):
    from sluice_server.engine.tiny_model import ensure_tiny_model

    (node,), placement = live_nodes(1)
    core = client.CoreV1Api(admin)
    (router,) = live_router.start(placement)
    claim(core, namespace, "weights")
    rwx_claim(core, namespace, "kv")
    shutil.copytree(ensure_tiny_model(), node.pvc_dir(namespace, "weights") / "tiny")

    def real(name: str, **spec) -> dict:
        body = load_sample("chat-small.yaml", namespace, new_name=name)
        body["spec"].update({
            "model": {"uri": "pvc://weights/tiny", "servedName": "tiny"},
            "engine": {"maxModelLen": 1024, "maxNumSeqs": 4},
            "resources": {"gpus": 1, "requests": {"cpu": "1", "memory": "4Gi"}, **placement},
            "streaming": {"streamTimeoutSeconds": 300},
            **spec,
        })  # fmt: skip
        return body

    # The reference: the same model without disaggregation (one plain pod, no connector).
    models.create(real("plain"))
    models.create(real("disagg", routing={"router": {"enabled": True}},
                       ingress={"enabled": True, "path": f"/{namespace}"},
                       disaggregation={"connector": {"type": "sharedStorage", "sharedStorage": {
                           "claimName": "kv"}}}))  # fmt: skip
    started = time.monotonic()
    ready_model(models, namespace, "disagg", timeout=START_TIMEOUT)
    ready_model(models, namespace, "plain", timeout=START_TIMEOUT)
    TIMINGS["disaggregation live, real engine: apply -> both models Ready (s)"] = round(
        time.monotonic() - started
    )
    status = _pools_ready(models, namespace, "disagg", 1, 1)
    (prefill,) = _pool(models, namespace, "disagg", "prefill")
    (decode,) = _pool(models, namespace, "disagg", "decode")
    (plain,) = live_pods(models, namespace, "plain")
    args = " ".join(decode.spec.containers[0].args or [])
    assert "--disaggregation-role decode" in args and "ExampleConnector" in args, args
    _router_knows(router, namespace, "disagg")
    url = _through_ingress(ingress, namespace)
    plain_url = f"http://{plain.status.pod_ip}:8000"
    decode_addr = f"{decode.status.pod_ip}:8000"

    rows = {}
    for protocol in PROTOCOLS:
        text = _prompt()
        got, cached = _stream(url, protocol, text, "tiny")
        expected, plain_cached = _stream(plain_url, protocol, text, "tiny")
        rows[protocol] = (cached, plain_cached, len(got))
        assert cached and cached > 0 and not plain_cached, (protocol, rows[protocol])
        assert got == expected and len(got) > 0, (protocol, got, expected)
    cached_in = sum(c for c, _, _ in rows.values())

    # The counters agree: the decode pod took in what its usage reported, the prefill pod
    # sent out every prompt, the router ran each prompt once on the prefill pod.
    assert metric_sum(metrics_page(decode_addr), "sluice_kv_transfer_tokens_total",
                direction="in", role="decode") == cached_in  # fmt: skip
    assert metric_sum(metrics_page(f"{prefill.status.pod_ip}:8000"), "sluice_kv_transfer_tokens_total",
                direction="out", role="prefill") > cached_in  # fmt: skip
    text = metrics_page(router.address)
    assert metric_sum(text, "sluice_router_prefills_total", namespace=namespace, model="disagg",
                result="ok") == len(PROTOCOLS)  # fmt: skip
    assert metric_sum(text, "sluice_router_prefills_total", namespace=namespace, model="disagg",
                result="failed") == 0  # fmt: skip

    # Negative control: the decode pod without the router (no prefill, no params) computes
    # the whole prompt.
    _, alone = _stream(f"http://{decode_addr}/{namespace}", "completions", _prompt(), "tiny")
    assert alone == 0, alone

    TIMINGS["disaggregation live, real engine: cached / plain pod cached / characters, "
            "per protocol"] = json.dumps(rows)  # fmt: skip
    TIMINGS["disaggregation live, real engine: status.pools"] = json.dumps(status.get("pools"))


class Client(threading.Thread):
    """One stream through the ingress on one protocol; its text, cached tokens and verdict."""

    def __init__(self, url: str, protocol: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.protocol, self.i = url, protocol, i
        self.cached: int | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            _, self.cached = _stream(
                self.url, self.protocol, f"stream {self.i} " + _prompt(), "sim"
            )
        except Exception as e:  # noqa: BLE001 - the verdict names it
            self.error = f"{type(e).__name__}: {e}"[:300]


def test_a_prefill_pod_killed_mid_prompt_its_prompts_run_on_the_other(
    operator, models, namespace, live_nodes, live_router, ingress, footprint
):
    (node,), placement = live_nodes(1)
    (router,) = live_router.start(placement)
    # A prompt takes 15 s on a prefill pod: every stream's prompt is placed (the router's
    # picks) well before the first one ends, so the kill finds prompts in flight.
    body = sim_model(namespace, "pd", placement,
                     routing={"router": {"enabled": True}},
                     disaggregation={"prefill": {"replicas": 2}, "decode": {"replicas": 1}},
                     engine={"simulator": {"ttftMs": 15000, "itlMs": 10, "ttftPerStreamMs": 0,
                                           "jitter": 0}})  # fmt: skip
    models.create(body)
    ready_model(models, namespace, "pd")
    _pools_ready(models, namespace, "pd", 2, 1)
    _router_knows(router, namespace, "pd")
    url = _through_ingress(ingress, namespace)
    prefill = sorted(p.metadata.name for p in _pool(models, namespace, "pd", "prefill")
                     if pod_ready(p))  # fmt: skip
    assert len(prefill) == 2, prefill

    def picks() -> float:
        return metric_sum(metrics_page(router.address), "sluice_router_picks_total", namespace=namespace,
                    model="pd")  # fmt: skip

    before = picks()
    clients = [Client(url, PROTOCOLS[i % len(PROTOCOLS)], i) for i in range(STREAMS)]
    for c in clients:
        c.start()
    # A pick per prompt on a prefill pod, and one per WebSocket: its socket opens to a
    # decode pod at once.
    sockets = sum(1 for c in clients if c.protocol == "websocket")
    eventually(lambda: picks() - before == STREAMS + sockets, timeout=60, interval=0.1,
               message="every prompt placed on a prefill pod")  # fmt: skip
    assert not any(c.error for c in clients), [c.error for c in clients]
    victim = prefill[0]
    pid = node.pod(victim, namespace).container("server").pid1()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for c in clients:
        c.join(timeout=300)
    broken = [(c.protocol, c.i, c.error, c.cached) for c in clients if c.error or not c.cached]
    assert not broken, broken
    text = metrics_page(router.address)
    counts = {r: metric_sum(text, "sluice_router_prefills_total", namespace=namespace, model="pd",
                      result=r) for r in ("ok", "failed", "refused", "cancelled")}  # fmt: skip
    # The prompts on the killed pod broke off (failed) and ran again on the other (ok): one
    # `ok` per stream, and each stream whole with its prompt's blocks handed over.
    assert counts["failed"] > 0, counts
    assert counts["ok"] == STREAMS and counts["refused"] == counts["cancelled"] == 0, counts
    TIMINGS["disaggregation live, prefill pod SIGKILLed: streams whole / prefills ok, failed"] = (
        f"{STREAMS} of {STREAMS} / {counts['ok']:.0f}, {counts['failed']:.0f}"
    )
