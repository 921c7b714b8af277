"""Small clients shared by the server tests (plain httpx / websockets, no magic)."""

from __future__ import annotations

import json

import httpx


async def sse_events(client: httpx.AsyncClient, method: str, path: str, **kw) -> list[dict]:
    """All events of an SSE response as dicts {id, event, data} (data raw string)."""
    events, cur = [], {}
    async with client.stream(method, path, **kw) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line == "":
                if cur:
                    events.append(cur)
                cur = {}
            elif line.startswith(":"):
                continue
            else:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                cur[field] = cur.get(field, "") + value if field == "data" else value
    return events


def token_payloads(events: list[dict]) -> list[dict]:
    return [json.loads(e["data"]) for e in events if e.get("data") not in (None, "[DONE]")]


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    return err


def ws_url(base_url: str, path: str = "/ws/stream") -> str:
    return base_url.replace("http://", "ws://") + path
