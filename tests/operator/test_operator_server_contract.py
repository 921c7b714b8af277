"""The command line the operator renders is accepted by the real server's parser
(docs/design.md is the contract; this checks both sides agree). Skipped only when the
server package is not installed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from operator_helpers import SAMPLES, load
from sluice_operator.builders.continuation import migrates
from sluice_operator.builders.deployment import desired_deployment, desired_pool_deployment
from sluice_operator.builders.disaggregation import kv_transfer_config
from sluice_operator.builders.kvevents import kv_event_args
from sluice_operator.builders.leaderworkerset import desired_leaderworkerset
from sluice_operator.models.resource import OperatorDefaults, StreamingModel, pool_view
from sluice_operator.render import offline_weights
from sluice_operator.validation import load_model

settings_mod = pytest.importorskip("sluice_server.settings")

# What LWS puts into every container's environment and Kubernetes expands in its args.
SECRET_VALUE = "value-from-secret"
LWS_ENV = {"$(LWS_LEADER_ADDRESS)": "deepseek-r1-0.deepseek-r1.models", "$(LWS_WORKER_INDEX)": "1"}


def _pod(model: StreamingModel, role: str = "leaderTemplate", pool: str | None = None) -> dict:
    """The server's pod spec: the Deployment's, a LeaderWorkerSet's leader or worker, or a
    disaggregated model's `pool`'s."""
    if pool is not None:
        workload = desired_pool_deployment(pool)(model)  # type: ignore[arg-type]
    else:
        workload = desired_deployment(model) or desired_leaderworkerset(model)
    assert workload is not None
    spec = workload["spec"]
    template = (
        spec["leaderWorkerTemplate"][role] if "leaderWorkerTemplate" in spec else spec["template"]
    )
    return template["spec"]


def server_container(
    model: StreamingModel, role: str = "leaderTemplate", pool: str | None = None
) -> dict:
    """The server container: the Deployment's, a LeaderWorkerSet's leader or worker, or a
    disaggregated model's `pool`'s."""
    (c,) = _pod(model, role, pool)["containers"]
    assert c["command"] == ["sluice-server"]
    return {**c, "args": [LWS_ENV.get(a, a) for a in c["args"]]}


def mount_secrets(model: StreamingModel, root: Path, pool: str | None = None) -> dict:
    """The server container as the kubelet would start it, under `root`: each Secret volume's
    items written below `root` (a placeholder value per key), and the paths in its arguments
    and environment moved there with them."""
    c = server_container(model, pool=pool)
    volumes = {v["name"]: v for v in _pod(model, pool=pool)["volumes"]}
    moved = {}
    for mount in c["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        here = root / mount["mountPath"].lstrip("/")
        here.mkdir(parents=True)
        for item in secret["items"]:
            (here / item["path"]).write_text(f"{SECRET_VALUE}-{secret['secretName']}\n")
        moved[mount["mountPath"] + "/"] = f"{here}/"

    def move(value: str) -> str:
        for old, new in moved.items():
            if value.startswith(old):
                return new + value.removeprefix(old)
        return value

    env = [{**e, "value": move(e["value"])} if "value" in e else e for e in c["env"]]
    return {**c, "args": [move(a) for a in c["args"]], "env": env}


# Each sample's server pod; a disaggregated sample's pods of both pools.
PODS = [
    (p, pool)
    for p in SAMPLES
    for pool in (("prefill", "decode") if load_model(load(p)).disaggregated else (None,))
]


@pytest.mark.parametrize(
    "path,pool", PODS, ids=lambda v: v.stem if isinstance(v, Path) else (v or "")
)
def test_server_parses_rendered_args(path, pool, monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("SLUICE_") or k.startswith("HF_TOKEN")]:
        monkeypatch.delenv(key)
    body = load(path)
    # A weights-cache model: its commit; the operator with the router's continuation key.
    keyed = OperatorDefaults(continuation_key=b"master")
    model = offline_weights(load_model(body, defaults=keyed), body)
    c = mount_secrets(model, tmp_path, pool)
    for env in c["env"]:  # the environment the server reads (HF_TOKEN_PATH, SLUICE_*)
        if env["name"].startswith(("SLUICE_", "HF_TOKEN")):
            monkeypatch.setenv(env["name"], env["value"])
    s = settings_mod.parse_settings(c["args"])
    if pool is not None:  # the pool's role and connector; its own replicas, GPUs, tensor
        assert s.disaggregation_role == pool
        model = pool_view(model, pool)  # type: ignore[arg-type]
        assert json.loads(s.kv_transfer_config) == kv_transfer_config(model)
    else:
        assert s.disaggregation_role is None and s.kv_transfer_config is None
    spec = model.spec
    assert s.port == 8000 and s.engine == spec.engine.backend
    assert s.model_label == model.served_name
    assert sorted(s.protocols) == sorted(spec.streaming.protocols)
    assert s.stream_timeout_seconds == spec.streaming.stream_timeout_seconds
    assert s.drain_timeout_seconds == spec.streaming.stream_timeout_seconds
    assert s.max_concurrent_streams == spec.streaming.max_concurrent_streams
    assert (s.api_key_file is not None) is (spec.auth.api_key_secret_ref is not None)
    assert (s.jwt_jwks_file is not None) is (spec.auth.jwt is not None)
    limit = spec.auth.rate_limit
    assert s.rate_limit_backend == limit.backend
    assert (s.rate_limit_rpm, s.rate_limit_tpm) == (limit.requests_per_minute,
                                                     limit.tokens_per_minute)  # fmt: skip
    if limit.backend == "redis":
        assert s.rate_limit_failure_mode == limit.failure_mode
        ref = limit.redis_url_secret_ref
        assert s.redis_url.get_secret_value() == f"{SECRET_VALUE}-{ref.name}"
    token = spec.model.hf_token_secret_ref
    env = {e["name"]: e.get("value") for e in c["env"]}
    if spec.model.cache.weights is not None:  # the commit's folder, the Hub off, no token
        assert s.model == "/mnt/weights" and env["HF_HUB_OFFLINE"] == "1"
        assert not {"HF_TOKEN_PATH", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"} & env.keys()
    elif token:  # huggingface_hub reads it from there
        path = dict((e["name"], e["value"]) for e in c["env"])["HF_TOKEN_PATH"]
        assert Path(path).read_text().strip() == f"{SECRET_VALUE}-{token.name}"
    assert s.playground is spec.streaming.playground
    # A router model's continuation key: the mounted file the flag names.
    assert (s.continuation_key_file is not None) is migrates(model)
    if s.continuation_key_file is not None:
        assert s.continuation_key_file.read_text().strip() == (
            f"{SECRET_VALUE}-{model.name}-continuation-key"
        )
    ing, gw = spec.ingress, spec.gateway  # the route's path prefix, passed on unchanged
    prefix = gw.path if gw is not None else ing.path if ing.enabled else ""
    assert s.root_path == prefix.rstrip("/")
    assert s.resume_grace_seconds == spec.streaming.resume.grace_seconds
    cors = spec.streaming.cors
    assert s.cors_allowed_origins == list(cors.allowed_origins)
    if cors.allowed_origins:
        assert s.cors_max_age_seconds == cors.max_age_seconds
        if cors.allowed_headers is not None:
            assert s.cors_allowed_headers == list(cors.allowed_headers)
    if spec.engine.backend == "vllm":
        assert s.tensor_parallel_size == spec.parallelism.tensor
        assert s.pipeline_parallel_size == spec.parallelism.pipeline
        assert s.gpu_memory_utilization == spec.engine.gpu_memory_utilization
        assert s.engine_args == kv_event_args(model) + list(spec.engine.extra_args)
        assert (s.nnodes, s.node_rank, s.headless) == (spec.parallelism.nodes, 0, False)
    else:
        sim = spec.engine.simulator
        assert s.sim_ttft_ms == sim.ttft_ms and s.sim_itl_ms == sim.itl_ms


MULTI_NODE = [p for p in SAMPLES if load_model(load(p)).multi_node]


@pytest.mark.parametrize("path", MULTI_NODE, ids=lambda p: p.stem)
def test_server_parses_a_workers_args_as_the_leaders_engine_on_another_rank(path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLUICE_")]:
        monkeypatch.delenv(key)
    model = load_model(load(path))
    leader = settings_mod.parse_settings(server_container(model)["args"])
    worker = settings_mod.parse_settings(server_container(model, "workerTemplate")["args"])
    assert worker.headless and not leader.headless and worker.node_rank == 1
    same = ("model", "revision", "engine", "tensor_parallel_size", "pipeline_parallel_size",
            "nnodes", "master_addr", "master_port", "gpu_memory_utilization", "max_model_len",
            "max_num_seqs", "max_num_batched_tokens", "dtype", "quantization", "engine_args")  # fmt: skip
    assert {k: getattr(worker, k) for k in same} == {k: getattr(leader, k) for k in same}
    assert leader.master_addr == LWS_ENV["$(LWS_LEADER_ADDRESS)"]
