"""The first of a disaggregated model's two steps (docs/disaggregation.md): the request's
prompt run on a prefill pod, whose answer is the KV-transfer parameters the decode pod gets
with the request itself.

`Prefill.run` sends `POST /internal/prefill` to the prefill pod its pool's `Upstream` places
the request on (prefix locality and load, placement.py), with the model's router key in
`X-Sluice-Continuation-Key` (the key continuations use, migration.py `key_for`), the
caller's own headers (the pod authenticates the caller as on the original route) and
`{"method": "POST", "path", "body"}`: the original request, its JSON body as received
(never parsed here; a token stream's GET as the POST body its route reads from the query). The pod answers 200 `{"kv_transfer_params": {...} |
null, "prompt_tokens": N}`; `run` returns the parameters as a `Handover`. On HTTP the
decode pod gets them in `X-Sluice-KV-Transfer`, base64url of their JSON (core/kvtransfer.py
`encode`, as the pods read it), beside the router key; on a WebSocket in the generate frame
(relay.py `Prefills`). Without parameters (the engine returned none) the decode pod gets
the request as it is and computes the prompt itself.

- A pod that cannot be reached, answers 5xx or breaks off its answer is left out (as a
  refused connection leaves a pod out, `Upstream.down`) and the prefill is sent to another
  prefill pod, at most `MAX_ATTEMPTS` times in all; then `PrefillFailed`, which the proxy
  turns into the protocol's error. No prefill pod a candidate before the first attempt:
  `NoPod` (the proxy holds the request again).
- A 4xx is the client's (its credential, a request the route refuses): `run` returns the
  pod's answer, head read, for the proxy to relay as it is.
- The client leaving cancels `run`: its connection to the prefill pod closes at once, so
  the pod's abort on disconnect stops the engine request.

Counted in `sluice_router_prefills_total{namespace,model,result}` per attempt (`ok`,
`refused`: a 4xx, `failed`: retried or given up, `cancelled`: the client left) and
`sluice_router_prefill_seconds{namespace,model}` (a prefill that answered 200: sent to its
answer read).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx

from ..core import kvtransfer
from ..core.auth.routerkey import KEY_HEADER
from .hop import Relay
from .metrics import RouterMetrics
from .migration import key_for
from .prefixindex import BlockHash
from .upstream import Upstream

log = logging.getLogger(__name__)
KV_HEADER = kvtransfer.HEADER
MAX_ATTEMPTS = 3  # prefill pods asked per request at most (a fleet-wide fault: not more)


@dataclass(frozen=True)
class Handover:
    """What a prefill gave the decode step: the engine's KV-transfer parameters (None: it
    returned none) and the model's key the decode pod checks beside them."""

    params: dict[str, Any] | None
    key: bytes

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The decode request's headers. Without parameters (`null`: vLLM's shared-storage
        connectors find the prompt's KV by its hash) the header still says the request is a
        decode, so the pod counts the prompt tokens it was spared; `null` asks nothing of
        the engine."""
        return [(KEY_HEADER, self.key), (KV_HEADER, kvtransfer.encode(self.params).encode())]


class PrefillFailed(Exception):
    """No prefill pod ran the prompt; the message is for a person (the client's error)."""


class NoPod(Exception):
    """No prefill pod is a candidate now, before any was asked: hold the request again."""


def prefill_body(path: str, body: bytes) -> bytes:
    """The body of `POST /internal/prefill`: the original request (its JSON body as
    received, never parsed here)."""
    return b"".join(
        [b'{"method":"POST","path":', json.dumps(path).encode(), b',"body":', body or b"null", b"}"]
    )


def query_as_body(query: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A token stream's GET as the POST body its route reads from the query (each
    parameter, `stop` a list when repeated, `api_key` left out) and the header that carries
    an `api_key` credential instead."""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    body: dict[str, Any] = {}
    stops = [v for k, v in pairs if k == "stop"]
    for k, v in pairs:
        if k != "api_key":
            body[k] = v
    if len(stops) > 1:
        body["stop"] = stops
    key = next((v for k, v in pairs if k == "api_key"), None)
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode("latin-1"))]
    return json.dumps(body).encode(), headers


class Prefill:
    """One request's prefill on `up`, the model's prefill pool."""

    def __init__(
        self, client: Relay, up: Upstream, metrics: RouterMetrics, key_file: Path | None
    ) -> None:
        self.client, self.up, self.key_file = client, up, key_file
        labels = (up.model.namespace, up.model.name)
        self._results = {
            r: metrics.prefills.labels(*labels, r) for r in ("ok", "refused", "failed", "cancelled")
        }
        self._seconds = metrics.prefill_seconds.labels(*labels)

    async def run(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        tie: bytes,
        hashes: Sequence[BlockHash] | None,
    ) -> Handover | httpx.Response:
        """What the decode step gets, or a prefill pod's 4xx answer (head read) to relay. `headers`: the
        caller's, as forwarded; `tie`: the request's placement tie-break; `hashes`: its
        prompt's block hashes (None: unknown)."""
        model = self.up.model
        if self.key_file is None:
            raise PrefillFailed(
                f"Model {model.key} is disaggregated, but this router has no "
                "--continuation-key-file: it cannot authenticate to the prefill pods."
            )
        try:
            key = key_for(self.key_file, model.namespace, model.name)
        except OSError as e:
            raise PrefillFailed(f"The router cannot read its continuation key: {e}.") from None
        if method == "GET":  # the token stream's GET: its query is the request
            path, _, query = path.partition("?")
            body, auth = query_as_body(query.encode("latin-1"))
            if not any(k == b"authorization" for k, _ in headers):
                headers = [*headers, *auth]
        content = prefill_body(path, body)
        head = [(k, v) for k, v in headers if k != b"content-type"]
        head += [(b"content-type", b"application/json"), (KEY_HEADER, key)]
        tried: list[str] = []
        why = ""
        while len(tried) < MAX_ATTEMPTS:
            target = self.up.pick(tie, None, hashes, tried)
            if target is None:
                if not tried:
                    raise NoPod
                break
            tried.append(target.pod or target.url)
            t0 = time.monotonic()
            try:
                request = self.client.build_request(
                    "POST", target.url + "/internal/prefill", headers=head, content=content
                )
                response = await self.client.send(request)
                if 400 <= response.status_code < 500:
                    self._results["refused"].inc()
                    return response  # the client's error: relayed as it is
                raw = await response.aread()
                await response.aclose()
                if response.status_code == 200:
                    params = json.loads(raw).get("kv_transfer_params")
                    self._results["ok"].inc()
                    self._seconds.observe(time.monotonic() - t0)
                    if params is not None and not isinstance(params, dict):
                        raise ValueError("kv_transfer_params is not an object")
                    return Handover(params, key)
                why = f"answered {response.status_code}"
            except (asyncio.CancelledError, GeneratorExit):
                self._results["cancelled"].inc()
                raise
            except httpx.HTTPError as e:
                why = type(e).__name__
            except (ValueError, AttributeError):
                why = "answered 200 without a JSON object"
            finally:
                target.release()
            self._results["failed"].inc()
            self.up.down(target)
            log.info("%s: prefill on %s failed (%s)", model.key, tried[-1], why)
        raise PrefillFailed(
            f"No prefill pod of model {model.key} ran the prompt: asked {len(tried)} "
            f"({', '.join(tried)}), the last {why}. Retry; if it persists, the model's "
            "prefill pods need attention (their logs, `kubectl get pods`)."
        )
