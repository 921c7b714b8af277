"""Disaggregated serving's pieces without a server: `--kv-transfer-config` reaches vLLM's
own parser and config validation (a NIXL configuration as the operator renders one for
GPUs), a config vLLM refuses stops the start with vLLM's reason, and the router's header
and the prefill's body are what core/kvtransfer.py says. Nothing is started."""

from __future__ import annotations

import json

import pytest
from sluice_server.core import kvtransfer
from sluice_server.settings import parse_settings

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backends": ["UCX"]}}  # fmt: skip


def test_vllm_parses_and_validates_the_connector_config():
    from sluice_server.engine import resolve_model
    from sluice_server.engine.vllm_engine import parse_vllm_args
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings = parse_settings(["--model", "tiny", "--kv-transfer-config", json.dumps(NIXL)])
    args = parse_vllm_args(settings, resolve_model("tiny"))
    assert args.enable_prompt_tokens_details is True
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config().kv_transfer_config
    assert (config.kv_connector, config.kv_role) == ("NixlConnector", "kv_both")
    assert config.is_kv_transfer_instance and config.kv_connector_extra_config == {
        "backends": ["UCX"]
    }


def test_a_config_vllm_refuses_stops_the_start_with_its_reason():
    from sluice_server.engine import resolve_model
    from sluice_server.engine.vllm_engine import parse_vllm_args

    bad = json.dumps({**NIXL, "kv_role": "kv_sideways"})
    settings = parse_settings(["--model", "tiny", "--kv-transfer-config", bad])
    with pytest.raises(ValueError, match="not a valid vLLM KVTransferConfig.*kv_role"):
        parse_vllm_args(settings, resolve_model("tiny"))


def test_without_a_config_no_connector_flags_reach_vllm():
    from sluice_server.engine.vllm_argv import vllm_cli_args

    args = vllm_cli_args(parse_settings(["--model", "tiny"]), "/m", cpu_defaults=False)
    assert not {"--kv-transfer-config", "--enable-prompt-tokens-details"} & set(args)


@pytest.mark.parametrize("params", [{"remote_block_ids": [1, 2], "remote_host": "10.0.0.7"}, None])
def test_the_header_round_trips(params):
    value = kvtransfer.encode(params)
    assert "=" not in value and "+" not in value and "/" not in value
    assert kvtransfer.decode(value) == (params or {})


@pytest.mark.parametrize("value", ["***", "WzFd", "bm90IGpzb24"])  # not base64, [1], "not json"
def test_a_malformed_header_says_why(value):
    with pytest.raises(ValueError, match="X-Sluice-KV-Transfer"):
        kvtransfer.decode(value)


@pytest.mark.parametrize(
    "path, field",
    [("/v1/chat/completions", "max_tokens"), ("/v1/completions", "max_tokens"),
     ("/v1/responses", "max_output_tokens"), ("/v1/messages", "max_tokens"),
     ("/v1/stream", "max_tokens")],
)  # fmt: skip
def test_a_prefill_runs_one_token_unstreamed_asking_for_a_remote_decode(path, field):
    body = {"prompt": "p", field: 500, "max_completion_tokens": 500, "min_tokens": 20,
            "stream": True, "stream_options": {"include_usage": True}, "n": 1}  # fmt: skip
    if path == "/v1/stream":  # always a stream: the body has no `stream`
        del body["stream"]
    out = kvtransfer.prefill_body(path, body)
    assert out[field] == 1 and out["kv_transfer_params"]["do_remote_decode"] is True
    assert not {"max_completion_tokens", "min_tokens", "stream_options", "n"} & set(out)
    assert out.get("stream", False) is False and body[field] == 500  # the original is kept
