"""Three real vLLM pods behind the Sluice router: placement by prefix cache, live.

The tiny model (real vLLM CPU engine) with `replicas: 3` and `spec.routing.router.enabled`,
deployed by the operator; each pod's KV cache is `BLOCKS` blocks of 128 tokens
(`engine.extraArgs: --num-gpu-blocks-override`), less than the workload's prefixes take
(`GROUPS x PREFIX_BLOCKS`) and more than a third of them. The chart's router (activator)
Deployment runs on the live node as rendered (live_helpers.LiveRouter); the Ingress names
`<name>-activator`, so requests go e2e ingress -> router -> pod, and the router follows each
pod's KV events (vLLM's wildcard endpoint bound to the pod's address by the node agent).

The same workload (sluice_bench.placement_live: groups of requests sharing long prefixes,
each phase with prefixes of its own) runs four times, and vLLM's own prefix-cache counters
(`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, each pod's /metrics,
summed) give each phase's hit rate:
- prefix: the router as the chart configures it, the model's `routing.balance` at its
  default (least-loaded: the router's prefix and load scores);
- round robin: the model patched to `routing.balance: round-robin`, which reaches the router
  through its models file alone (the same three pods, the same router pod);
- least-loaded: the router re-rendered from the chart with `activator.extraArgs:
  [--prefix-weight=0]` (a rollout of its Deployment), placing by load alone;
- one pod: the model scaled to 1 replica, the same cache size, through the same router.

The test asserts: every request answered through the router, the router following all 3
pods' KV events (`sluice_router_kv_feeds_live`), every pod served in the fleet phases, the
router hashing the prompts (the tokenizer read from the pods) and picking most requests by
prefix, each request in turn with round robin and by load alone with prefix weight 0 (the
negative controls), the round-robin patch rolling no pod, and the fleet's hit rate with
prefix placement above round robin's and least-loaded's, as the engines counted them. The
0.9 x one pod ratio is the benchmark's, in the table, not asserted. The table goes to the e2e
timings; with `SLUICE_BENCH_WRITE=1` (`make bench-placement-live`) also into
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest
from e2e_harness.kube import eventually, load_sample
from kubernetes import client
from sluice_bench import placement_live as bench

from .conftest import OPERATOR_NAMESPACE, TIMINGS
from .live_helpers import ROUTER, claim, live_pods, ready_model

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.usefixtures("footprint")]

NAME, SERVED = "fleet", "tiny"
BLOCK = 128  # vLLM's KV block on the CPU build (tests/server/test_router_kv_engine.py)
BLOCKS = 16  # per pod: 3 groups' prefixes fit, 9 do not
GROUPS, PREFIX_BLOCKS, PER_GROUP = 9, 4, 10
MAX_MODEL_LEN = 1024
START_TIMEOUT = 900  # three engines starting at once on two shared cores


def _router_metrics(ip: str) -> str:
    return httpx.get(f"http://{ip}:8000/metrics", timeout=5).text


def _mine(ns: str) -> dict[str, str]:
    return {"namespace": ns, "model": NAME}


def test_three_real_pods_behind_the_router_count_prefix_cache_hits_by_placement(
    operator, models, namespace, live_nodes, live_router, ingress, admin
):
    from sluice_server.engine.tiny_model import ensure_tiny_model
    from tokenizers import Tokenizer

    (node,), placement = live_nodes(1)
    core = client.CoreV1Api(admin)
    started = time.monotonic()
    (ep,) = live_router.start(placement)
    claim(core, namespace, "weights")
    tiny = ensure_tiny_model()
    shutil.copytree(tiny, node.pvc_dir(namespace, "weights") / "tiny")
    body = load_sample("chat-small.yaml", namespace, new_name=NAME)
    body["spec"].update({
        "model": {"uri": "pvc://weights/tiny", "servedName": SERVED},
        "replicas": 3,
        "engine": {"maxModelLen": MAX_MODEL_LEN, "maxNumSeqs": 4,
                   "extraArgs": ["--num-gpu-blocks-override", str(BLOCKS)]},
        "resources": {"gpus": 1, "requests": {"cpu": "1", "memory": "4Gi"}, **placement},
        "streaming": {"streamTimeoutSeconds": 120},
        "ingress": {"enabled": True, "path": f"/{namespace}"},
        "routing": {"router": {"enabled": True}},
    })  # fmt: skip
    models.create(body)
    ready_model(models, namespace, NAME, timeout=START_TIMEOUT)
    eventually(lambda: len([p for p in live_pods(models, namespace, NAME)
                            if p.status.pod_ip]) == 3, timeout=60, message="3 pods")  # fmt: skip
    TIMINGS["router placement: router + 3 real pods, apply -> model Ready (s)"] = round(
        time.monotonic() - started)  # fmt: skip
    ing = client.NetworkingV1Api(admin).read_namespaced_ingress(NAME, namespace)
    backend = ing.spec.rules[0].http.paths[0].backend.service.name
    assert backend == f"{NAME}-activator", backend
    url = f"{ingress.url}/{namespace}"
    upstream = re.sub(r"[^A-Za-z0-9_]", "_", f"{namespace}_{NAME}-activator_8000")

    def through(router_ep) -> None:
        """The ingress routes the model to this router pod alone, and the model answers."""
        eventually(lambda: ingress.reloads and ingress.reloads[-1].endpoints.get(upstream)
                   == (router_ep.address,), timeout=60, interval=0.25,
                   message="the ingress to route the model to the router pod")  # fmt: skip
        eventually(lambda: httpx.get(f"{url}/v1/models", timeout=5).status_code == 200,
                   timeout=60, message="the model through ingress -> router")  # fmt: skip

    through(ep)

    def feeds(ip: str) -> float:
        return bench.samples(_router_metrics(ip), "sluice_router_kv_feeds_live", **_mine(namespace))

    def picks(ip: str) -> dict[str, float]:
        text = _router_metrics(ip)
        return {by: bench.samples(text, "sluice_router_picks_total", **_mine(namespace), by=by)
                for by in (*bench.PICKED_BY, "pin")}  # fmt: skip

    def forwarded(ip: str) -> float:
        return bench.samples(_router_metrics(ip), "sluice_activator_requests_total",
                             **_mine(namespace), outcome="forwarded")  # fmt: skip

    def reloads(ip: str) -> float:
        return bench.samples(_router_metrics(ip), "sluice_activator_models_reloads_total",
                             result="ok")  # fmt: skip

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tok.encode(text).ids) + 1  # and the BOS token vLLM adds

    def work(tag: str) -> bench.Workload:
        return bench.workload(count, tag=tag, groups=GROUPS, per_group=PER_GROUP, block=BLOCK,
                              prefix_blocks=PREFIX_BLOCKS)  # fmt: skip

    def pods_now() -> list[str]:
        return [f"http://{p.status.pod_ip}:8000" for p in live_pods(models, namespace, NAME)]

    def engines() -> set[tuple[str, str, int]]:
        """Each model pod: (name, uid, restarts): what a roll or a restart changes."""
        return {(p.metadata.name, p.metadata.uid,
                 sum(c.restart_count for c in p.status.container_statuses or []))
                for p in live_pods(models, namespace, NAME)}  # fmt: skip

    def phase(name: str, ip: str, pods: list[str], w: bench.Workload) -> bench.Phase:
        before_picks, before_fwd = picks(ip), forwarded(ip)
        t0 = time.monotonic()
        got = bench.run_phase(bench.Phase(name, len(pods)), url, SERVED, pods, w.requests)
        after = picks(ip)
        got.picks = {k: after[k] - before_picks[k] for k in after}
        TIMINGS[f"router placement: {name} phase, {len(w.requests)} requests (s)"] = round(
            time.monotonic() - t0, 1)  # fmt: skip
        assert not got.errors and got.ok == len(w.requests), got.errors[:5]
        # Every request went through the router (its forwarded count, its picks).
        assert forwarded(ip) - before_fwd == len(w.requests)
        assert sum(got.picks.values()) == len(w.requests), got.picks
        return got

    def balance(value: str, ip: str) -> None:
        """Patch the model's routing.balance; return once the router reloaded its models
        file (the operator rewrote it, the node agent refreshed the volume)."""
        seen = reloads(ip)
        models.patch(namespace, NAME, {"spec": {"routing": {"balance": value}}})
        eventually(lambda: reloads(ip) > seen, timeout=60, interval=0.5,
                   message=f"the router to reload its models file (balance {value})")  # fmt: skip

    # (a) The router as the chart configures it.
    fleet = pods_now()
    w = work("alpha")
    prefix = phase("prefix (router as configured)", ep.ip, fleet, w)
    assert prefix.pods_served == 3, prefix.per_pod
    assert prefix.picks["prefix"] >= len(w.requests) // 2, prefix.picks
    # A pod's feed is live from its first event batch on: every pod has stored blocks now.
    eventually(lambda: feeds(ep.ip) == 3, timeout=60, interval=0.5,
               message="the router following the 3 pods' KV events")  # fmt: skip

    # (b) Round robin: the model's balance, through the models file; no pod rolls.
    pods_before = engines()
    balance("round-robin", ep.ip)
    rr = phase("round robin (routing.balance)", ep.ip, fleet, work("delta"))
    assert rr.picks["round-robin"] == len(w.requests), rr.picks
    assert rr.pods_served == 3, rr.per_pod
    assert engines() == pods_before, (pods_before, engines())
    balance("least-loaded", ep.ip)

    # (c) The router re-rendered from the chart with its prefix weight 0: load alone.
    values = {"activator.extraArgs[0]": "--prefix-weight=0"}
    ep = live_router.roll(values, placement)
    through(ep)
    (container,) = client.AppsV1Api(admin).read_namespaced_deployment(
        ROUTER, OPERATOR_NAMESPACE).spec.template.spec.containers  # fmt: skip
    assert "--prefix-weight=0" in container.args, container.args
    least = phase("least-loaded (prefix weight 0)", ep.ip, fleet, work("bravo"))
    assert least.pods_served == 3, least.per_pod
    assert least.picks["prefix"] == 0 and least.picks["round-robin"] == 0, least.picks
    # The engines' own counts: prefix placement kept the groups' prefixes cached.
    assert prefix.hit_rate > rr.hit_rate, (prefix.per_pod, rr.per_pod)
    assert prefix.hit_rate > least.hit_rate, (prefix.per_pod, least.per_pod)
    eventually(lambda: feeds(ep.ip) == 3, timeout=60, interval=0.5,
               message="the new router following the 3 pods' KV events")  # fmt: skip

    # (d) One pod, the same cache, the same workload, through the same router.
    models.patch(namespace, NAME, {"spec": {"replicas": 1}})
    eventually(lambda: len(live_pods(models, namespace, NAME)) == 1, timeout=180, interval=1,
               message="one pod left")  # fmt: skip
    eventually(lambda: feeds(ep.ip) == 1, timeout=60, interval=0.5,
               message="the router following the one pod")  # fmt: skip
    single = phase("one pod (same cache size)", ep.ip, pods_now(), work("charlie"))
    assert single.pods_served == 1, single.per_pod
    # The engines counted hits: one pod meets each group's prefix again while it is cached.
    assert single.hits > 0, single.per_pod

    phases = [prefix, rr, least, single]
    found = bench.targets(prefix, rr, least, single)
    text = bench.section(phases, found, w, block=BLOCK, cache_blocks=BLOCKS,
                         prefix_blocks=PREFIX_BLOCKS)  # fmt: skip
    print("\n" + text)
    TIMINGS["router placement: table"] = "\n" + text
    TIMINGS["router placement: workload"] = json.dumps({
        "groups": GROUPS, "per_group": PER_GROUP, "prefix_tokens": w.prefix_tokens,
        "prompt_tokens": w.prompt_tokens, "cache_blocks_per_pod": BLOCKS, "block": BLOCK})  # fmt: skip
    if os.environ.get("SLUICE_BENCH_WRITE") == "1":
        bench.write(text)
