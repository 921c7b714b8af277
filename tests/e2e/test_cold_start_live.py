"""A cold start phase by phase (docs/autoscaling.md): a model whose weights are in the
weights cache (`hf://` on the Hub stand-in, testkit.fake_hub), with autoscaling.minReplicas
0, idles to zero; one streamed request through the ingress wakes it through the chart's
activator on the live node (test_scale_to_zero_live.py's set-up, one model).

The phases of the pod that answered come from what the system recorded
(e2e_harness/coldstart.py): the activator's log line (arrival, forward), the pod's status
(created, scheduled, container started, Ready: whole seconds, refined by a watch of the
pod), the server's `sluice_startup_phase_seconds` anchored at its process's start (its own
log line). The table is printed; every phase must be there and in order. The first request's time
to first token less the pod's created -> Ready, against the model's normal time to first
token (a second request on the now warm pod, same run), is reported with the issue's 1 s
target met or not (0.48-0.6 s on a quiet machine, 1.2 s once beside CI and a real-engine
e2e); the test fails past 3 s, which a poller that waits an idle period before looking for
demand again (scaletozero_poller.py before its idle rounds were followed by a demand-period
one) exceeds: 6.5 s from the request to the pod's creation."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx
import pytest
from e2e_harness import coldstart
from e2e_harness.kube import eventually
from e2e_harness.service_proxy import ServiceProxy
from kubernetes import client, watch

from .conftest import OPERATOR_NAMESPACE, TIMINGS
from .live_helpers import live_pods, ready_model, rwx_claim, sim_model

TARGET_S = 1.0  # the target for |(cold TTFT - created -> Ready) - warm TTFT|
GROSS_S = 3.0  # past this the test fails (the poller's old delay made it 7.2 s)

fake_hub = pytest.importorskip("testkit.fake_hub", reason="the Hub stand-in")
pytest.importorskip("sluice_server.weights", reason="the download program")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("footprint")]

IDLE_SECONDS = 30
TOKENS = 8
FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 64}',
    "tokenizer.json": b'{"version": "1.0"}' * 200,
    "model.safetensors": bytes(range(256)) * 8192,  # 2 MiB, stored with LFS
}
# Every phase a simulator pod passes (no vLLM: no `engine_imported`).
EXPECTED = [p for p in coldstart.ORDER if p != "engine_imported"]


class PodWatch:
    """When a watch of the model's pods first saw each pod created, scheduled and Ready
    (sub-second; the pods' own timestamps are whole seconds)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, selector: str) -> None:
        self.core, self.namespace, self.selector = core, namespace, selector
        self.seen: dict[str, dict[str, float]] = {}
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stopped = False

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()

    def _run(self) -> None:
        stream = self._watch.stream(self.core.list_namespaced_pod, self.namespace,
                                    label_selector=self.selector, timeout_seconds=600)  # fmt: skip
        try:
            for event in stream:
                now, pod = time.time(), event["object"]
                mine = self.seen.setdefault(pod.metadata.name, {})
                mine.setdefault("pod_created", now)
                conds = {c.type: c.status for c in pod.status.conditions or []}
                if conds.get("PodScheduled") == "True":
                    mine.setdefault("scheduled", now)
                if conds.get("Ready") == "True":
                    mine.setdefault("pod_ready", now)
        except Exception:  # stop() closes the stream under it
            if not self._stopped:
                raise


def _stream(url: str, content: str) -> dict:
    """One token SSE stream: sent, first token (the first data event), tokens, how it ended."""
    rec: dict = {"sent": time.time(), "first": None}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": TOKENS}
    with httpx.stream("POST", f"{url}/v1/stream", json=body, timeout=300) as r:
        rec["status"], lines = r.status_code, []
        for line in r.iter_lines():
            if line.startswith("data: {") and rec["first"] is None:
                rec["first"] = time.time()
            lines.append(line)
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    rec["tokens"] = next((e["usage"]["completion_tokens"] for e in events if e.get("usage")), 0)
    rec["done"] = "data: [DONE]" in lines
    rec["ttft"] = rec["first"] - rec["sent"] if rec["first"] else None
    return rec


def test_a_cached_model_scales_from_zero_phase_by_phase(
    operator, models, namespace, live_nodes, live_router, ingress, admin, control_plane
):
    core = client.CoreV1Api(admin)
    (node,), placement = live_nodes(1)
    name = "cold"
    key = f"{namespace}/{name}"
    proxy = ServiceProxy(core, namespace, name, f"127.4.{random.randint(0, 250)}."
                         f"{random.randint(1, 250)}", 8000).start()  # fmt: skip
    pod_watch = None
    try:
        aliases = [{"ip": proxy.ip, "hostnames": [f"{name}.{namespace}.svc.cluster.local"]}]
        (ep,) = live_router.start(placement, replicas=1, hostAliases=aliases)
        act_log = node.log_dir / f"{OPERATOR_NAMESPACE}.{ep.pod}.activator.log"
        rwx_claim(core, namespace, "weights")
        with fake_hub.FakeHub() as hub:
            hub.add_repo("org/tiny", FILES)
            body = sim_model(namespace, name, placement)
            body["spec"]["model"] = {
                "uri": "hf://org/tiny@main",
                "cache": {"weights": {"claimName": "weights", "hubEndpoint": hub.url}},
            }
            body["spec"]["autoscaling"] = {
                "minReplicas": 0, "maxReplicas": 1,
                "scaleToZero": {"idleSeconds": IDLE_SECONDS, "holdTimeoutSeconds": 300},
            }  # fmt: skip
            models.create(body)
            ready_model(models, namespace, name, timeout=240)

            # Idle: to zero (the last pod gone, not only terminating), the route on the
            # activator.
            eventually(lambda: not models.pods(namespace, name), timeout=IDLE_SECONDS + 180,
                       interval=0.5, message="the scale to zero")  # fmt: skip
            upstream = re.sub(r"[^A-Za-z0-9_]", "_", f"{namespace}_{name}-activator_8000")
            eventually(lambda: ingress.reloads and ingress.reloads[-1].endpoints.get(upstream)
                       == (f"{ep.ip}:8000",), timeout=60, interval=0.25,
                       message="the ingress to route the model to the activator")  # fmt: skip
            requests_at_zero = len(hub.requests)

            # One streamed request while nothing runs: held, the model scaled to 1.
            pod_watch = PodWatch(core, namespace, f"app.kubernetes.io/instance={name}").start()
            url = f"{ingress.url}/{namespace}"
            cold = _stream(url, "wake up")
            assert (cold["status"], cold["tokens"], cold["done"]) == (200, TOKENS, True), cold
            (pod,) = live_pods(models, namespace, name)

            # The route back on the model's Service: the same request on the warm pod.
            eventually(lambda: ingress.reloads and not ingress.reloads[-1].endpoints.get(
                upstream), timeout=60, interval=0.25, message="the route back")  # fmt: skip
            warm = _stream(url, "wake up")
            assert (warm["status"], warm["tokens"], warm["done"]) == (200, TOKENS, True), warm
            # The pod started from the cache: nothing asked the Hub.
            assert len(hub.requests) == requests_at_zero

        pod_json = client.ApiClient().sanitize_for_serialization(pod)
        page = httpx.get(f"http://{pod.status.pod_ip}:8000/metrics", timeout=5).text
        server_log = (node.log_dir / f"{namespace}.{pod.metadata.name}.server.log").read_text()
        (held,) = coldstart.activator_forwards(act_log.read_text(), key)
        phases = coldstart.pod_phases(
            pod_json, page, arrival=held[0], container="server",
            started=coldstart.process_start(server_log), forwarded=held[1],
            first_token=cold["first"], seen=pod_watch.seen.get(pod.metadata.name),
        )  # fmt: skip
        # What the table was made of, for the unit tests' fixtures.
        record = control_plane.workdir / "cold-start"
        record.mkdir(exist_ok=True)
        (record / "pod.json").write_text(json.dumps(pod_json, indent=1, default=str))
        (record / "metrics.txt").write_text(page)
        (record / "times.json").write_text(json.dumps({
            "arrival": held[0], "forwarded": held[1], "first_token": cold["first"],
            "started": coldstart.process_start(server_log),
            "seen": pod_watch.seen.get(pod.metadata.name), "cold": cold, "warm": warm}))  # fmt: skip
        print("\n" + coldstart.table(pod.metadata.name, phases))

        assert [p.name for p in phases] == EXPECTED, phases
        # The watch saw each change within its whole second (and the watch's lag) of the
        # pod's own timestamp: it missed none.
        whole = {p.name: p.at for p in coldstart.pod_phases(pod_json, page, arrival=held[0])}
        for phase, at in pod_watch.seen[pod.metadata.name].items():
            assert whole[phase] <= at < whole[phase] + 1 + coldstart.SEEN_LAG, (phase, at, whole)
        assert not coldstart.out_of_order(phases), coldstart.out_of_order(phases)
        at = {p.name: p.at for p in phases}
        to_ready = at["pod_ready"] - at["pod_created"]
        beyond = cold["ttft"] - to_ready
        print(f"first request TTFT {cold['ttft']:.3f} s, pod created -> Ready {to_ready:.3f} s, "
              f"difference {beyond:.3f} s; warm TTFT {warm['ttft']:.3f} s")  # fmt: skip
        apart = abs(beyond - warm["ttft"])
        TIMINGS["cold start: TTFT cold, created -> Ready, cold - that, warm TTFT (s); target "
                "|cold - that - warm| <= 1 s"] = (
            round(cold["ttft"], 3), round(to_ready, 3), round(beyond, 3), round(warm["ttft"], 3),
            "met" if apart <= TARGET_S else "not met")  # fmt: skip
        # The target is reported, not asserted (a loaded machine stretches any wall-clock
        # span); what fails the test is a gap no load explains: a request that waits
        # seconds for its pod to be created, as the scale-to-zero poller once made it.
        assert apart <= GROSS_S, (beyond, warm["ttft"], phases)
    finally:
        if pod_watch is not None:
            pod_watch.stop()
        proxy.stop()
