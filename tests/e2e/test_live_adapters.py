"""LoRA adapters added and removed on a running real-engine pod, without replacing it.

The operator renders the Deployment for vLLM on the tiny model with LoRA on; the live node
agent runs it under bubblewrap with two API workers, the weights and the adapters (made at
test time, PEFT's files) on one bound PersistentVolumeClaim, API keys from a Secret. The
model starts with one adapter; then `spec.adapters` changes on the running model:
- an adapter is added: the operator rewrites the `<name>-adapters` ConfigMap, the agent
  swaps the mounted file as the kubelet does, both workers load it into the running engine;
  it answers a stream by name (its answer at temperature 0 differs from the base's), a key
  limited to it lists only it in /v1/models, status.adapters lists it Ready;
- an adapter is removed: it leaves /v1/models and is a 404 `model_not_found`;
and it is the same pod all along: same UID, restartCount 0, no container exit, the
Deployment's template untouched (its generation is the same). The counterpart: raising
`engine.lora.maxLoras` (fixed at engine start) rolls the pod, AdaptersReady says
`EngineRestart` meanwhile, and the new pod serves the current adapters from its start.

The hot-add latency comes from what the system recorded: the API server's time of the spec
change (managedFields), the ConfigMap write, each worker's "loaded" log line, and the
AdaptersReady condition's transition (the operator looks again every few seconds while an
adapter loads); it lands in the e2e timings, it is not asserted.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil

import httpx
import pytest
from e2e_harness.kube import eventually, load_sample
from kubernetes import client

from .conftest import TIMINGS
from .live_helpers import claim, live_pods, pod_ready, ready_model, routed, sse_tokens

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.usefixtures("footprint")]
KEY = "e2e-live-key-0123456789abcdef"
LIMITED = "e2e-limited-key-0123456789ab"  # may use the added adapter only
# The engine and two front ends start in about 2 minutes on two idle cores; on a shared
# machine (load 14 measured) it took more than 5.
START_TIMEOUT = 900
SETTLE = 180  # an adapter change seen in the status: the operator looks again every 10 s
CHAT = {"messages": [{"role": "user", "content": "hello river"}], "max_tokens": 16,
        "temperature": 0}  # fmt: skip
_LINE = re.compile(r"^(\S+ \S+) INFO \S+ adapters: (\S+) (loaded from|unloaded)", re.M)


def _stamp(text: str) -> dt.datetime:
    """An RFC 3339 time from the API server (seconds) as an aware datetime."""
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _log_time(text: str) -> dt.datetime:
    """The server log's `asctime` (the pod's local time: the host's, UTC here)."""
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=dt.UTC)


def _spec_changed_at(obj: dict) -> dt.datetime:
    """When the API server recorded the last write of spec.adapters (the managedFields
    entry of the manager that owns it: this test's client)."""
    times = [_stamp(m["time"]) for m in obj["metadata"].get("managedFields") or []
             if not m.get("subresource") and "f:adapters" in json.dumps(m.get("fieldsV1"))]  # fmt: skip
    assert times, obj["metadata"].get("managedFields")
    return max(times)


def _stream(base: str, headers: dict, model: str) -> tuple[int, str, str]:
    """(status, the answer's text, the raw stream) of a streamed OpenAI chat for `model`."""
    r = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=60,
                   json={**CHAT, "model": model, "stream": True,
                         "stream_options": {"include_usage": True}})  # fmt: skip
    text = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    return r.status_code, text, r.text


def test_adapters_change_on_a_running_pod_without_replacing_it(
    operator, models, namespace, live_nodes, ingress, admin
):
    from sluice_server.engine.tiny_model import ensure_tiny_model
    from testkit.lora import make_adapter

    (node,), placement = live_nodes(1, cpus={0})
    core = client.CoreV1Api(admin)
    claim(core, namespace, "weights")
    volume = node.pvc_dir(namespace, "weights")
    tiny = ensure_tiny_model()
    shutil.copytree(tiny, volume / "tiny")
    for i, name in enumerate(("first", "second")):
        make_adapter(volume / "adapters" / name, tiny, seed=i)
    keys = f"{KEY}\n{LIMITED} tenant=limited models=second\n"
    core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="keys"), string_data={"keys": keys}))  # fmt: skip
    first = {"name": "first", "uri": "pvc://weights/adapters/first"}
    second = {"name": "second", "uri": "pvc://weights/adapters/second"}
    body = load_sample("chat-small.yaml", namespace, new_name="lora")
    body["spec"].update({
        "model": {"uri": "pvc://weights/tiny", "servedName": "base"},
        "engine": {"maxModelLen": 512, "maxNumSeqs": 8,
                   "lora": {"maxLoras": 2, "maxLoraRank": 8}},
        "adapters": [first],
        "server": {"apiWorkers": 2},
        "resources": {"gpus": 1, "requests": {"cpu": "1", "memory": "4Gi"}, **placement},
        "auth": {"apiKeySecretRef": {"name": "keys", "key": "keys"}},
        "ingress": {"enabled": True, "path": f"/{namespace}/llm"},
    })  # fmt: skip
    models.create(body)
    ready_model(models, namespace, "lora", timeout=START_TIMEOUT)
    auth = {"Authorization": f"Bearer {KEY}"}
    limited = {"Authorization": f"Bearer {LIMITED}"}
    base = routed(ingress, core, namespace, "lora", 1, path=f"/{namespace}/llm", headers=auth)

    def listed(headers: dict) -> list[tuple[str, str | None]]:
        r = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return [(m["id"], m.get("parent")) for m in r.json()["data"]]

    def adapter_states() -> dict[str, str]:
        st = models.get(namespace, "lora").get("status") or {}
        return {a["name"]: a["state"] for a in st.get("adapters") or []}

    eventually(lambda: adapter_states() == {"first": "Ready"}, timeout=SETTLE, interval=1,
             message="status.adapters: first Ready")  # fmt: skip
    assert listed(auth) == [("base", None), ("first", "base")]
    status, base_text, raw = _stream(base, auth, "base")
    assert status == 200 and sse_tokens(raw) == (16, "length", True), raw[-300:]
    (pod,) = live_pods(models, namespace, "lora")
    deployment = models.apps.read_namespaced_deployment("lora", namespace)

    def config_map_written() -> dt.datetime:  # only the operator writes it
        cm = core.read_namespaced_config_map("lora-adapters", namespace)
        return max(m.time for m in cm.metadata.managed_fields)

    before = config_map_written()

    server_log = node.log_dir / f"{namespace}.{pod.metadata.name}.server.log"

    def logged(name: str, what: str) -> list[dt.datetime]:
        """When each API worker said it loaded (or unloaded) `name` (its own log line)."""
        text = server_log.read_text(errors="replace")
        return [_log_time(t) for t, n, w in _LINE.findall(text) if n == name and w == what]

    # Add an adapter on the running model: both workers load it, the status says Ready.
    patched = models.patch(namespace, "lora", {"spec": {"adapters": [first, second]}})
    changed = _spec_changed_at(patched)
    eventually(lambda: adapter_states() == {"first": "Ready", "second": "Ready"}, timeout=SETTLE,
             interval=1, message="status.adapters: second Ready")  # fmt: skip
    # The operator wrote the ConfigMap and the Deployment in the pass that followed the
    # change: a pod template that changed would have a new generation by now.
    now = models.apps.read_namespaced_deployment("lora", namespace)
    assert now.metadata.generation == deployment.metadata.generation
    loaded = eventually(lambda: len(logged("second", "loaded from")) == 2
                      and logged("second", "loaded from"), timeout=SETTLE, interval=0.5,
                      message="both API workers to load second")  # fmt: skip
    status, text, raw = _stream(base, auth, "second")
    assert status == 200 and sse_tokens(raw) == (16, "length", True), raw[-300:]
    assert text != base_text, (text, base_text)  # the adapter's weights are applied
    assert listed(auth) == [("base", None), ("first", "base"), ("second", "base")]
    assert listed(limited) == [("second", "base")]

    # The record: spec change -> ConfigMap written -> each worker loaded it -> status Ready.
    written = config_map_written()
    assert written > before, (written, before)
    cond = models.condition(namespace, "lora", "AdaptersReady") or {}
    assert cond.get("status") == "True", cond
    ready_at = _stamp(cond["lastTransitionTime"])
    TIMINGS["live adapters: spec change -> ConfigMap, -> loaded by both workers, -> status "
            "Ready (s)"] = (f"{(written - changed).total_seconds():.1f}, "
                            f"{(max(loaded) - changed).total_seconds():.1f}, "
                            f"{(ready_at - changed).total_seconds():.1f}")  # fmt: skip
    assert changed - dt.timedelta(seconds=1) <= min(loaded), (changed, loaded)

    # Remove one: both workers unload it; gone from the list, a 404 naming what is served.
    models.patch(namespace, "lora", {"spec": {"adapters": [second]}})
    eventually(lambda: len(logged("first", "unloaded")) == 2, timeout=SETTLE, interval=0.5,
             message="both API workers to unload first")  # fmt: skip
    assert listed(auth) == [("base", None), ("second", "base")]
    status, _, raw = _stream(base, auth, "first")
    assert status == 404 and "model_not_found" in raw and "`second`" in raw, raw
    eventually(lambda: adapter_states() == {"second": "Ready"}, timeout=SETTLE, interval=1,
             message="status.adapters: second alone")  # fmt: skip

    # The same pod all along, never restarted; the pod template never changed.
    (after,) = live_pods(models, namespace, "lora")
    assert after.metadata.uid == pod.metadata.uid, (after.metadata.name, pod.metadata.name)
    assert after.status.container_statuses[0].restart_count == 0
    assert not [e for e in node.exits if e["pod"] == pod.metadata.name], node.exits
    now = models.apps.read_namespaced_deployment("lora", namespace)
    assert now.metadata.generation == deployment.metadata.generation
    assert [p.metadata.uid for p in models.pods(namespace, "lora")] == [pod.metadata.uid]

    # The counterpart: a LoRA limit vLLM fixes at engine start rolls the pod, the status
    # says why while it does, and the new pod serves the current list from its start.
    models.patch(namespace, "lora", {"spec": {"engine": {"lora": {"maxLoras": 3}}}})

    def restarting():
        c = models.condition(namespace, "lora", "AdaptersReady") or {}
        return c.get("reason") == "EngineRestart" and c

    seen = eventually(
        restarting, timeout=SETTLE, interval=0.5, message="AdaptersReady EngineRestart"
    )
    assert seen["status"] == "False" and "rolling update" in seen["message"], seen

    def rolled():
        pods = live_pods(models, namespace, "lora")
        return len(pods) == 1 and pods[0].metadata.uid != pod.metadata.uid and pod_ready(
            pods[0]) and pods[0]  # fmt: skip

    new = eventually(rolled, timeout=START_TIMEOUT, interval=1, message="the new pod")
    assert models.apps.read_namespaced_deployment("lora", namespace).metadata.generation > (
        deployment.metadata.generation)  # fmt: skip
    eventually(lambda: adapter_states() == {"second": "Ready"} and (models.condition(
        namespace, "lora", "AdaptersReady") or {}).get("status") == "True", timeout=SETTLE,
        interval=1, message="the new pod's adapters Ready")  # fmt: skip
    base = routed(ingress, core, namespace, "lora", 1, path=f"/{namespace}/llm", headers=auth)
    status, _, raw = _stream(base, auth, "second")
    assert status == 200 and sse_tokens(raw) == (16, "length", True), raw[-300:]
    new_log = node.log_dir / f"{namespace}.{new.metadata.name}.server.log"
    assert new_log.read_text(errors="replace").count("adapters: second loaded from") == 2
