"""One real vLLM pod (tiny model, CPU) under the control plane, through the ingress.

The operator renders the Deployment; the live node agent runs it under bubblewrap with
its weights on a PersistentVolumeClaim (a PV bound by the real PV controller, the claim's
folder bind-mounted read-only), API keys and the HF token from Secret volumes, and the
ingress path prefix. Then:
- token SSE, WebSocket and OpenAI chat stream through the ingress URL, a request without a
  key is refused;
- a wedged engine: the engine-core process inside the pod is killed; the pod goes unready,
  the container is restarted (by its liveness probe, or by its own exit when the server
  notices first: the status and the agent's record say which), the ingress routes it again
  and it serves, and the model's status went from Ready to not Ready and back.
The engine processes are pinned to CPU 0 (the node agent's `cpus`), apart from the
ingress and this test's client, as the environment notes advise; the verdicts are the
streams' content, not their timing.
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import psutil
import pytest
from e2e_harness.kube import eventually, load_sample
from kubernetes import client

from .conftest import TIMINGS
from .live_helpers import claim, live_pods, pod_ready, ready_model, routed, sse_tokens

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.usefixtures("footprint")]
KEY = "e2e-live-key-0123456789abcdef"
START_TIMEOUT = 300  # the engine starts in 66-87 s on two idle cores; the machine is shared


def test_real_engine_pod_streams_through_the_ingress_and_recovers_from_a_wedged_engine(
    operator, models, namespace, live_nodes, ingress, admin
):
    from sluice_server.engine.tiny_model import ensure_tiny_model

    (node,), placement = live_nodes(1, cpus={0})
    core = client.CoreV1Api(admin)
    claim(core, namespace, "weights")
    shutil.copytree(ensure_tiny_model(), node.pvc_dir(namespace, "weights") / "tiny")
    core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="keys"), string_data={"keys": KEY + "\n", "hf": "x"}))  # fmt: skip
    body = load_sample("chat-small.yaml", namespace, new_name="real")
    body["spec"].update({
        "model": {"uri": "pvc://weights/tiny", "servedName": "real",
                  "hfTokenSecretRef": {"name": "keys", "key": "hf"}},
        "engine": {"maxModelLen": 512, "maxNumSeqs": 8},
        "resources": {"gpus": 1, "requests": {"cpu": "1", "memory": "4Gi"}, **placement},
        "streaming": {"streamTimeoutSeconds": 60},
        "auth": {"apiKeySecretRef": {"name": "keys", "key": "keys"}},
        "ingress": {"enabled": True, "path": f"/{namespace}/llm"},
    })  # fmt: skip
    models.create(body)
    started = time.monotonic()
    ready_model(models, namespace, "real", timeout=START_TIMEOUT)
    TIMINGS["live real engine: apply -> model Ready (s)"] = round(time.monotonic() - started)
    auth = {"Authorization": f"Bearer {KEY}"}
    base = routed(ingress, core, namespace, "real", 1, path=f"/{namespace}/llm", headers=auth)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 24}

    # Token SSE, OpenAI chat (streamed), WebSocket: all through the ingress, under the prefix.
    r = httpx.post(f"{base}/v1/stream", json=chat, headers=auth, timeout=60)
    assert r.status_code == 200 and sse_tokens(r.text) == (24, "length", True), r.text[-300:]
    r = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=60,
                   json={**chat, "model": "real", "stream": True,
                         "stream_options": {"include_usage": True}})  # fmt: skip
    assert r.status_code == 200 and sse_tokens(r.text) == (24, "length", True), r.text[-300:]
    assert httpx.post(f"{base}/v1/stream", json=chat, timeout=30).status_code == 401
    from websockets.sync.client import connect

    ws_url = base.replace("http://", "ws://") + f"/ws/stream?api_key={KEY}"
    frames = []
    with connect(ws_url, open_timeout=30) as ws:
        ws.send(
            json.dumps({"id": "w1", "messages": chat["messages"], "params": {"max_tokens": 24}})
        )
        while not (frames and frames[-1].get("finished")):
            frames.append(json.loads(ws.recv(timeout=60)))
    assert frames[-1]["finish_reason"] == "length", frames[-1]
    assert frames[-1]["usage"]["completion_tokens"] == 24, frames[-1]

    # A wedged engine: kill the engine core inside the pod.
    (pod,) = live_pods(models, namespace, "real")
    runtime = node.pod(pod.metadata.name, namespace)
    sandbox = psutil.Process(runtime.pids()[0])
    cores = [p for p in sandbox.children(recursive=True) if "EngineCore" in " ".join(p.cmdline())
             or "EngineCore" in p.name()]  # fmt: skip
    assert cores, [p.cmdline() for p in sandbox.children(recursive=True)]
    killed = time.monotonic()
    for p in cores:
        p.kill()
    seen: dict[str, float] = {}

    def recovered():
        p = core.read_namespaced_pod(pod.metadata.name, namespace)
        phase = (models.get(namespace, "real").get("status") or {}).get("phase")
        if not pod_ready(p):
            seen.setdefault("pod unready", time.monotonic() - killed)
        if phase != "Ready":
            seen.setdefault(f"model {phase}", time.monotonic() - killed)
        restarts = p.status.container_statuses[0].restart_count
        if restarts:
            seen.setdefault("restarted", time.monotonic() - killed)
        return restarts >= 1 and pod_ready(p) and phase == "Ready" and p

    p = eventually(recovered, timeout=60 + START_TIMEOUT, interval=1, message="the pod to recover")
    why = [e["why"] for e in node.exits if e["pod"] == pod.metadata.name]
    TIMINGS["live wedged engine: seen after the kill (s), exit reason"] = (
        f"{ {k: round(v) for k, v in seen.items()} }, {why}")  # fmt: skip
    assert "pod unready" in seen and any(k.startswith("model ") for k in seen), seen
    assert why, node.exits
    last = p.status.container_statuses[0].last_state.terminated
    assert last is not None, p.status.container_statuses[0]
    # Ready again is the pod's word; the ingress follows in its own time (it renders the
    # endpoint back and reloads): wait until it routes the pod and the model answers there,
    # as a client of a real controller would.
    base = routed(ingress, core, namespace, "real", 1, path=f"/{namespace}/llm", headers=auth)
    r = httpx.post(f"{base}/v1/stream", json=chat, headers=auth, timeout=60)
    assert r.status_code == 200 and sse_tokens(r.text) == (24, "length", True), r.text[-300:]
