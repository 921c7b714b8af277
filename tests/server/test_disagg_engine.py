"""Disaggregated serving on the real engine (tiny model, vLLM's CPU build): a prefill pod and
a decode pod, each its own engine process with vLLM's shared-storage connector
(`ExampleConnector`, a folder both see: the CPU stand-in for NIXL). `POST /internal/prefill`
on the prefill pod runs the prompt for one token, which writes its KV cache to the folder;
the prefill pod's engine then stops, and a decode pod on a fresh engine answers the
original request sent as the router sends it (the router key, `X-Sluice-KV-Transfer` with
what the prefill returned): its usage reports the prompt's full blocks as cached (loaded,
not computed: its own prefix cache is empty) and its temperature-0 text is the text of a
plain pod (the session engine, no connector). Negative control: a prompt no prefill ran
gets 0 cached tokens on the same decode pod.

`ExampleConnector` returns no params (null) and reads the folder by the prompt's hash, so
this proves the engines' hand-over and the pods' entries; the params' hand-over is proven
against the simulator (test_disagg_simulator.py)."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
from app_helpers import another_engine, engine_settings, serving
from continuation_helpers import KEY, KEYED, events_of, fresh_prompt
from sluice_server.core import kvtransfer
from testkit.net import free_port

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


def body(text: str) -> dict:
    return {"model": "tiny", "prompt": text, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


def text_and_usage(raw: str) -> tuple[str, dict]:
    text, usage = "", None
    for event in events_of(raw):
        data = event.removeprefix("data: ")
        if not data.startswith("{"):
            continue
        chunk = json.loads(data)
        text += "".join(c.get("text", "") for c in chunk.get("choices", []))
        usage = chunk.get("usage") or usage
    assert usage is not None, raw
    return text, usage


@contextlib.asynccontextmanager
async def pod(tiny_model_path, engine_overrides: dict, **app_overrides):
    """An app on its own engine (with the connector), served on a free loopback port."""
    from sluice_server.app import build_app
    from sluice_server.serve import uvicorn_config

    async with another_engine(engine_settings(tiny_model_path, **engine_overrides)) as engine:
        port = free_port()
        settings = engine_settings(tiny_model_path, port=port, **engine_overrides, **app_overrides)
        async with serving(uvicorn_config(settings, build_app(settings, engine))):
            yield f"http://127.0.0.1:{port}"


async def test_the_decode_pod_loads_the_prompt_the_prefill_pod_computed(
    make_server, tiny_model_path, tmp_path
):
    key = tmp_path / "router-key"
    key.write_text(KEY + "\n")
    connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}  # fmt: skip
    engine = {"kv_transfer_config": json.dumps(connector)}
    text = fresh_prompt()

    plain = await make_server()
    async with httpx.AsyncClient(base_url=plain, timeout=120) as c:
        r = await c.post("/v1/completions", json=body(text))
        assert r.status_code == 200, r.text
        expected, _ = text_and_usage(r.text)
    assert len(expected) > 20

    async with (
        pod(tiny_model_path, engine, disaggregation_role="prefill",
            continuation_key_file=key) as url,
        httpx.AsyncClient(base_url=url, timeout=120) as c,
    ):  # fmt: skip
        entry = {"path": "/v1/completions", "body": body(text)}
        r = await c.post("/internal/prefill", json=entry, headers=KEYED)
        assert r.status_code == 200, r.text
        prefilled = r.json()
        assert prefilled["prompt_tokens"] > 256, prefilled
        out = (await c.get("/metrics")).text
        n = float(prefilled["prompt_tokens"])
        assert f'{{direction="out",model="tiny",role="prefill"}} {n}' in out
    assert any((tmp_path / "kv").iterdir()), "the connector wrote no KV cache"

    header = {**KEYED, "X-Sluice-KV-Transfer": kvtransfer.encode(prefilled["kv_transfer_params"])}
    async with (
        pod(tiny_model_path, engine, disaggregation_role="decode",
            continuation_key_file=key) as url,
        httpx.AsyncClient(base_url=url, timeout=120) as c,
    ):  # fmt: skip
        r = await c.post("/v1/completions", json=body(text), headers=header)
        assert r.status_code == 200, r.text
        got, usage = text_and_usage(r.text)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert usage["prompt_tokens"] == prefilled["prompt_tokens"]
        assert 0 < cached < usage["prompt_tokens"], usage
        assert got == expected

        # Negative control: a prompt no prefill pod ran is computed here, all of it.
        r = await c.post("/v1/completions", json=body(fresh_prompt()), headers=header)
        assert r.status_code == 200, r.text
        assert text_and_usage(r.text)[1]["prompt_tokens_details"]["cached_tokens"] == 0

        metrics = (await c.get("/metrics")).text
        assert f'{{direction="in",model="tiny",role="decode"}} {float(cached)}' in metrics
