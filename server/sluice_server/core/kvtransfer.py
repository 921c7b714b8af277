"""Disaggregated serving on the pod's side (docs/disaggregation.md): a prefill pod runs a
prompt for a decode pod, and a decode pod generates after a prompt whose KV cache it
received.

Prefill. `POST /internal/prefill` (protocols/prefill_entry.py) re-enters the original
route with `PREFILL_KEY` in the ASGI scope. The route authenticates the caller and
validates the original request as it always does, then runs it with `prefill_body`: one
output token, not streamed, and the connector's `PREFILL_PARAMS` (vLLM's disaggregated
proxy's shape). It answers `{"kv_transfer_params": <the engine's>, "prompt_tokens": N}`.

Decode. The router sends the original request with `X-Sluice-KV-Transfer` (base64url of
the JSON params the prefill returned) and the router key. `transfer_in` accepts the header
only with the key (never from a client: the params name another engine's blocks to read),
and only on a decode pod; the engine gets the params (vLLM: `SamplingParams.extra_args`),
and usage reports the prompt tokens it did not compute as cached.

Clients never set `kv_transfer_params` in a body themselves (vLLM's request models have
the field): `CLIENT_FIELD` is refused by the routes.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any, Literal

from .auth.routerkey import KEY_HEADER, key_refusal
from .errors import ApiError

PREFILL_KEY = "sluice.prefill"  # the ASGI scope entry: this request is a remote prefill
HEADER = b"x-sluice-kv-transfer"
CLIENT_FIELD = "kv_transfer_params"
Role = Literal["prefill", "decode"]

# What the prefill request asks of the engine's connector: compute the prompt, keep its
# blocks for a decode engine to read (vLLM's `toy_proxy_server` sends the same).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# The field that bounds a request's output, per generating route.
_MAX_FIELD = {
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
    "/v1/stream": "max_tokens",
}
PREFILLABLE = tuple(_MAX_FIELD)
# Fields that make no sense for one output token that nobody reads (and that vLLM would
# refuse beside max_tokens 1: min_tokens > 1, a thinking budget).
_DROPPED = ("max_completion_tokens", "min_tokens", "stream_options", "n", "best_of")


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The validated original body as the prefill runs it: one output token, not streamed,
    the connector asked to keep the prompt's blocks for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out[_MAX_FIELD[path]] = 1
    if path != "/v1/stream":
        out["stream"] = False
    out[CLIENT_FIELD] = dict(PREFILL_PARAMS)
    return out


def encode(params: dict[str, Any] | None) -> str:
    """The header value for params: base64url (no padding) of their compact JSON."""
    raw = json.dumps(params, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode(value: str) -> dict[str, Any]:
    """The params a header value carries (JSON null, a prefill whose connector returned
    none, as vLLM's shared-storage connectors do: `{}`, which asks nothing of the engine);
    ValueError saying what is wrong."""
    try:
        raw = base64.urlsafe_b64decode(value.strip() + "=" * (-len(value.strip()) % 4))
        params = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"X-Sluice-KV-Transfer is not base64url of JSON: {e}") from None
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ValueError("X-Sluice-KV-Transfer must carry a JSON object (or null).")
    return params


def transfer_in(headers: Any, key_file: Path | None, role: Role | None) -> dict[str, Any] | None:
    """The decode params of a request (None without the header): the header is trusted
    only beside the router key (403 otherwise) and only on a decode pod (403 elsewhere);
    a malformed value is a 400."""
    value = headers.get(HEADER.decode())
    if value is None:
        return None
    given = headers.get(KEY_HEADER.decode())
    refusal = key_refusal(key_file, None if given is None else given.encode())
    if refusal is not None:
        raise ApiError(
            403,
            f"X-Sluice-KV-Transfer is accepted only from the Sluice router: {refusal[1]}",
            code="forbidden",
        )
    if role != "decode":
        raise ApiError(
            403,
            "X-Sluice-KV-Transfer is accepted only by a decode pod (--disaggregation-role decode).",
            code="forbidden",
        )
    try:
        return decode(value)
    except ValueError as e:
        raise ApiError(
            400, str(e), param="X-Sluice-KV-Transfer", code="invalid_kv_transfer"
        ) from None


def refuse_client_field(body: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) when a client's body names `kv_transfer_params` itself."""
    if CLIENT_FIELD in body:
        return CLIENT_FIELD, (
            "kv_transfer_params: set by the Sluice router for disaggregated serving, "
            "never by clients; leave it out."
        )
    return None


def cached_in_usage(body: dict[str, Any]) -> int | None:
    """The cached prompt tokens a whole answer's usage reports (OpenAI chat and
    completions, Responses, Anthropic Messages), None when it reports none."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int):
        return int(usage["cache_read_input_tokens"])
    for name in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(name)
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
    return None
