"""The multi-node arguments (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`):
refused early with a readable message when inconsistent, and otherwise passed to vLLM such
that vLLM's own parser and config validation (`create_engine_config`) accept them for the
leader and for a headless worker, with the ranks and rendezvous vLLM will use. Nothing is
started: the engine's multi-node run itself is not exercised here."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from sluice_server.settings import parse_settings

LEADER = ["--model", "tiny", "--pipeline-parallel-size", "2", "--nnodes", "2"]
ADDR = ["--master-addr", "10.0.0.7"]


@pytest.mark.parametrize(
    "argv, says",
    [
        ([*LEADER, *ADDR, "--node-rank", "2"], "--node-rank 2 must be below --nnodes 2"),
        (["--model", "tiny", "--node-rank", "1"], "--node-rank 1 must be below --nnodes 1"),
        (LEADER, "needs --master-addr"),
        ([*LEADER, *ADDR, "--engine", "simulator"], "needs --engine vllm"),
        (
            ["--model", "tiny", "--tensor-parallel-size", "3", "--nnodes", "2", *ADDR],
            "(3) must split evenly over --nnodes 2",
        ),
        ([*LEADER, *ADDR, "--api-workers", "2"], "--api-workers above 1 cannot be combined"),
    ],
)
def test_inconsistent_multinode_arguments_are_refused(argv, says):
    with pytest.raises(ValidationError) as info:
        parse_settings(argv)
    assert says in str(info.value)


def test_consistent_arguments_parse_and_a_rank_above_zero_is_headless():
    assert not parse_settings([*LEADER, *ADDR]).headless
    worker = parse_settings([*LEADER, *ADDR, "--node-rank", "1"])
    assert worker.headless and worker.master_port == 29501
    assert not parse_settings(["--model", "tiny"]).headless


def test_one_node_passes_no_multinode_flags():
    from sluice_server.engine.vllm_argv import vllm_cli_args

    args = vllm_cli_args(parse_settings(["--model", "tiny"]), "/m", cpu_defaults=False)
    assert not {"--nnodes", "--node-rank", "--master-addr", "--headless"} & set(args)


@pytest.fixture(scope="module")
def engine_configs():
    """vLLM's own parse and config validation of the leader's and a worker's arguments
    (the tiny model: its config is read, no weights are loaded)."""
    from sluice_server.engine import resolve_model
    from sluice_server.engine.vllm_engine import parse_vllm_args
    from vllm.engine.arg_utils import AsyncEngineArgs

    out = {}
    for rank in (0, 1):
        settings = parse_settings([*LEADER, *ADDR, "--node-rank", str(rank)])
        args = parse_vllm_args(settings, resolve_model("tiny"))
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config(headless=args.headless)
        out[rank] = (args, config.parallel_config)
    return out


def test_vllm_accepts_the_leaders_and_the_workers_arguments(engine_configs):
    for rank, (args, parallel) in engine_configs.items():
        assert args.headless is (rank > 0)
        assert (parallel.nnodes, parallel.node_rank) == (2, rank)
        assert (parallel.master_addr, parallel.master_port) == ("10.0.0.7", 29501)
        assert parallel.pipeline_parallel_size == 2 and parallel.world_size == 2
        # The multiprocessing backend across nodes (not Ray).
        assert parallel.distributed_executor_backend == "mp"


def test_vllm_refuses_what_we_refuse_too():
    """Negative control of the check above: vLLM's own validation rejects a world size the
    nodes do not divide, the case our settings refuse first with a clearer message."""
    from sluice_server.engine import resolve_model
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_args = AsyncEngineArgs(
        model=resolve_model("tiny"),
        tensor_parallel_size=3,
        nnodes=2,
        master_addr="10.0.0.7",
        enforce_eager=True,
    )
    with pytest.raises(Exception, match="nnodes"):
        engine_args.create_engine_config()


def test_a_worker_hands_vllms_headless_entry_point_what_vllm_serve_headless_would(monkeypatch):
    """`run_headless` as `vllm serve --headless` calls it (api_server_count 0: it refuses
    None, found when two processes were run as two nodes), here captured, not run."""
    import vllm.entrypoints.cli.serve as vllm_serve
    from sluice_server.engine import run_engine_worker

    seen = []
    monkeypatch.setattr(vllm_serve, "run_headless", seen.append)
    settings = parse_settings([*LEADER, *ADDR, "--node-rank", "1"])
    assert run_engine_worker(settings) == 0
    (args,) = seen
    assert args.headless and args.api_server_count == 0
    assert (args.nnodes, args.node_rank, args.master_addr) == (2, 1, "10.0.0.7")
