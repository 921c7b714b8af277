"""Placement by the prefix cache, end to end without a real engine: the router in front of
two simulator model servers with a prefix cache that publish their KV events, found
through a Pod watch (a fake API server).

The router fetches the model's prompt hasher from a pod (`GET /internal/prefix-cache`,
router/hashers.py), follows each pod's KV events (router/kvfeed.py) and places requests
sharing a long system prompt on the pod whose events say it holds that prompt. The negative
control is the same workload with the prefix weight at 0: fewer prompt tokens come from
the pods' caches.

The pods listen on 127.0.0.1 and 127.0.0.2 with the same ports, as the e2e node agent gives
each pod its loopback IP; their KV-event endpoints are the node agent's rewrite of
`tcp://*:P` (`tcp://[::ffff:<pod IP>]:P`, e2e_harness/sandbox.py), which the publisher binds
on that address only, and the router subscribes to `tcp://<pod IP>:P`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import httpx
import pytest
from e2e_harness.sandbox import zmq_own_endpoint
from router_helpers import HEADERS, LABELS, MODEL, model_server, pods_api, pods_entry, router
from sluice_server.engine.simcache import KvEventsConfig
from sluice_server.engine.simulator import SimulatorEngine
from testkit.net import free_port
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")
IPS = {"pod-a": "127.0.0.1", "pod-b": "127.0.0.2"}
GROUPS, PER_GROUP = 8, 4
SYSTEM_WORDS = 200  # 12 full blocks of 16 shared by a group's requests
CHAT = "/v1/chat/completions"


class Recording(SimulatorEngine):
    """The simulator with a prefix cache, noting each request's group (its system prompt's
    first word) by request id; its `prefills` say how many prompt tokens were cached."""

    def __init__(self, kv_events: KvEventsConfig) -> None:
        super().__init__(model_name="sim", ttft_ms=5, itl_ms=2, prefix_cache_blocks=10_000,
                         kv_events=kv_events)  # fmt: skip
        self.groups: dict[str, str] = {}

    def generate(self, request):
        self.groups[request.request_id] = self._prompt_text(request).split()[0]
        return super().generate(request)

    def served(self) -> list[tuple[str, int]]:
        """(group, cached prompt tokens) of each request this pod served."""
        return [(self.groups[p.request_id], p.cached_tokens) for p in self.prefills]


def events_config(ip: str, port: int, replay: int) -> KvEventsConfig:
    """The pod's `--kv-events-config` after the node agent's rewrite."""
    raw = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": zmq_own_endpoint(f"tcp://*:{port}", ip),
           "replay_endpoint": zmq_own_endpoint(f"tcp://*:{replay}", ip)}  # fmt: skip
    config = KvEventsConfig.from_json(json.dumps(raw))
    assert config is not None and config.endpoint == f"tcp://[::ffff:{ip}]:{port}"
    return config


@contextlib.asynccontextmanager
async def cached_pods(tmp_path, **router_settings):
    """The fake API server with pod-a and pod-b (simulators with a prefix cache and KV
    events) and the router watching them: (router, {pod: engine})."""
    port, kv, replay = free_port(), free_port(), free_port()
    engines = {name: Recording(events_config(ip, kv, replay)) for name, ip in IPS.items()}
    entry = pods_entry(port)
    entry["pods"]["kvEvents"] = {"port": kv, "replayPort": replay}
    sa = tmp_path / "serviceaccount"
    sa.mkdir(exist_ok=True)
    (sa / "token").write_text("router-token\n")
    async with contextlib.AsyncExitStack() as stack:
        api, api_url = await stack.enter_async_context(pods_api())
        for name, ip in IPS.items():
            api.put(name, ip, LABELS)
            await stack.enter_async_context(
                model_server(port, engines[name], host=ip, describe_prefix_cache=True)
            )
            stack.push_async_callback(engines[name].shutdown)
        act = await stack.enter_async_context(
            router(
                tmp_path,
                {MODEL: entry},
                kube_api_url=api_url,
                service_account_dir=sa,
                prefix_hasher_cache_dir=tmp_path / "tokenizers",
                **router_settings,
            )  # fmt: skip
        )
        yield act, engines


def body(group: int, i: int) -> bytes:
    system = " ".join(f"g{group}s{w}" for w in range(SYSTEM_WORDS))
    user = " ".join(f"g{group}q{i}u{w}" for w in range(12))
    return json.dumps({"model": "sim", "max_tokens": 16, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()  # fmt: skip


async def post(client: httpx.AsyncClient, raw: bytes) -> None:
    r = await client.post(
        CHAT, content=raw, headers={**HEADERS, "content-type": "application/json"}
    )
    assert r.status_code == 200, r.text


async def picks(act, by: str) -> float:
    return act.app.metrics.picks.labels(*MODEL.split("/"), by)._value.get()


async def workload(act, engines) -> dict[str, list[tuple[str, int]]]:
    """One request per group (its system prompt reaches one pod's cache and, through its
    KV events, the router's index), then the rest of every group at once, shuffled."""
    hasher = act.app.hashers[MODEL]
    await eventually_async(lambda: hasher.ready, timeout=15, message="the prompt hasher")
    view = act.app.views[MODEL]
    async with httpx.AsyncClient(base_url=act.url, timeout=30) as client:
        for g in range(GROUPS):
            await post(client, body(g, 0))

        def holders(g: int) -> list[str]:
            hashes = hasher(CHAT, body(g, 1), None)
            assert hashes is not None and len(hashes) == 13
            return [p for p in IPS if view.index.is_live(p)
                    and view.index.longest_prefix(p, hashes) >= 12]  # fmt: skip

        # The events have reached the router: each group's prefix is on exactly one pod.
        await eventually_async(lambda: all(len(holders(g)) == 1 for g in range(GROUPS)),
                               timeout=15, message="the KV events of every group")  # fmt: skip
        assert view.live_feeds() == 2
        rest = [(g, i) for g in range(GROUPS) for i in range(1, PER_GROUP)]
        random.Random(7).shuffle(rest)
        await asyncio.gather(*(post(client, body(g, i)) for g, i in rest))
    return {name: engine.served() for name, engine in engines.items()}


def cached_total(served: dict[str, list[tuple[str, int]]]) -> int:
    return sum(c for rows in served.values() for _, c in rows)


async def test_requests_sharing_a_prefix_go_to_the_pod_whose_events_hold_it(tmp_path):
    async with cached_pods(tmp_path) as (act, engines):
        served = await workload(act, engines)
        hasher = act.app.hashers[MODEL]
        assert hasher.source in IPS and hasher.fetches >= 1
        # Every group's first request went to one pod; all its others followed it there
        # and found the whole system prompt in that pod's cache (12 blocks of 16).
        home = {rows[0]: pod for pod, served_rows in served.items() for rows in served_rows
                if rows[1] == 0}  # fmt: skip
        assert len(home) == GROUPS and set(home.values()) == set(IPS)  # both pods used
        for pod, rows in served.items():
            later = [(g, c) for g, c in rows if c > 0]
            assert all(home[g] == pod for g, _ in later), (pod, rows)
            assert all(c == 12 * 16 for _, c in later), rows
        assert sum(len(rows) for rows in served.values()) == GROUPS * PER_GROUP
        assert await picks(act, "prefix") == GROUPS * (PER_GROUP - 1)
        with_prefix = cached_total(served)
        assert with_prefix == GROUPS * (PER_GROUP - 1) * 12 * 16
    # Negative control: the same workload placed by load alone caches less.
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    async with cached_pods(control_dir, prefix_weight=0.0) as (act, engines):
        served = await workload(act, engines)
        assert await picks(act, "prefix") == 0
        assert cached_total(served) < with_prefix
