"""A model published under a path prefix answers under it, through real nginx routing the
Ingress rule the operator renders (Prefix path, no rewrite) to a server started with the
`--root-path` the operator renders. Negative control: the same nginx in front of a server
without the flag answers 404 under the prefix."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets
from testkit.nginx_proxy import NginxProxy, find_nginx

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


def rendered(path: str) -> tuple[str, str | None]:
    """The Ingress rule path and the server's --root-path for `ingress.path: path`."""
    from sluice_operator.builders.args import server_args
    from sluice_operator.builders.ingress import desired_ingress
    from sluice_operator.validation import load_model

    body = {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "StreamingModel",
            "metadata": {"name": "m", "namespace": "default"},
            "spec": {"model": {"uri": "hf://x/y"},
                     "ingress": {"enabled": True, "path": path}}}  # fmt: skip
    model = load_model(body)
    (rule,) = desired_ingress(model)["spec"]["rules"][0]["http"]["paths"]
    args = server_args(model)
    root = args[args.index("--root-path") + 1] if "--root-path" in args else None
    return rule["path"], root


async def test_model_answers_under_its_prefix(make_server):
    if find_nginx() is None:
        pytest.skip("nginx not installed")
    from openai import AsyncOpenAI

    path, root = rendered("/mistral")
    assert root == "/mistral"
    url = await make_server(root_path=root)
    with NginxProxy(url, "ingress", path=path) as proxy:
        base = proxy.url + path
        client = AsyncOpenAI(base_url=base + "/v1", api_key="unused")
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage.completion_tokens == 8
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.get(base + "/v1/stream", params={"prompt": "hi", "max_tokens": "4"})
            assert r.status_code == 200 and "[DONE]" in r.text
            assert (await c.get(proxy.url + "/v1/models")).status_code == 404  # not published
        ws = proxy.ws_url + path + "/ws/stream"
        async with websockets.connect(ws, open_timeout=10) as sock:
            await sock.send(json.dumps({"id": "a", "prompt": "hi", "params": {"max_tokens": 3}}))
            while not (msg := json.loads(await sock.recv()))["finished"]:
                pass
            assert msg["usage"]["completion_tokens"] == 3

    plain = await make_server()  # negative control: no --root-path
    with NginxProxy(plain, "ingress", path=path) as proxy:
        async with httpx.AsyncClient() as c:
            assert (await c.get(proxy.url + path + "/v1/models")).status_code == 404
