"""Reserved `engine.extraArgs` flags against vLLM's own argument parser, and the engine flags
the operator adds for the router (KV events).

Every spelling vLLM's parser reads as a flag the operator sets (aliases, underscores,
abbreviations, `=value`, a value glued to a short flag) must be refused by the operator and by
the CRD's CEL pattern; every other vLLM flag must pass. The reserved lists are compared with
the parser's option strings, so an alias added in a vLLM release fails here.
"""

from __future__ import annotations

import re
import typing

import pytest
from operator_helpers import minimal
from sluice_operator.kinds import desired_children
from sluice_operator.models.engine import LoraRank
from sluice_operator.models.flags import (
    RESERVED_LONG,
    RESERVED_NOT_VLLM,
    RESERVED_RE,
    RESERVED_SHORT,
    RESERVED_VLLM_DESTS,
    positional_arg,
    reserved_flag,
)
from sluice_operator.validation import SpecError, load_model

pytest.importorskip("vllm")

RESERVED_DESTS = RESERVED_VLLM_DESTS
NOT_VLLM = RESERVED_NOT_VLLM


@pytest.fixture(scope="module")
def parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="sluice-server --"))


def _value(action) -> str:
    return str(next(iter(action.choices))) if action.choices else "7"


def _reads_as(parser, argv: list[str], dest: str) -> bool:
    """vLLM's parser accepts argv and sets `dest` from it."""
    try:
        ns = parser.parse_args(argv)
    except (SystemExit, OSError, ValueError, AssertionError):
        return False  # refused (--config 7: vLLM tries to read the file "7")
    default = parser.get_default(dest)
    return getattr(ns, dest) not in (default, None)


def _spellings(option: str, value: str) -> list[list[str]]:
    names = [option]
    if option.startswith("--"):
        names += [option[:i] for i in range(3, len(option))]
        names += ["--" + n[2:].replace("-", "_") for n in list(names)]
    else:
        names += [option[:i] for i in range(2, len(option))]
    out = [[n, value] for n in names] + [[f"{n}={value}"] for n in names]
    if len(option) == 2 and not option.startswith("--"):
        out.append([option + value])  # -qawq
    return out


def _refused(arg: str) -> bool:
    by_operator = reserved_flag(arg)
    by_cel = re.match(RESERVED_RE, arg) is not None
    assert by_operator == by_cel, (arg, by_operator, by_cel)
    return by_operator


def test_lora_rank_choices_are_vllms(parser):
    """engine.lora.maxLoraRank accepts exactly the ranks vLLM's --max-lora-rank does."""
    (action,) = [a for a in parser._actions if "--max-lora-rank" in a.option_strings]
    assert set(typing.get_args(LoraRank)) == set(action.choices)


def test_reserved_lists_are_every_option_string_of_the_reserved_destinations(parser):
    vllm = {s for a in parser._actions if a.dest in RESERVED_DESTS for s in a.option_strings}
    mine = set(RESERVED_LONG) | set(RESERVED_SHORT)
    assert mine - NOT_VLLM == vllm, (
        "a vLLM release added or dropped an alias: update models/flags.py"
    )


def test_every_spelling_vllm_reads_as_a_reserved_flag_is_refused(parser):
    checked = 0
    for action in parser._actions:
        if action.dest not in RESERVED_DESTS:
            continue
        value = _value(action)
        for option in action.option_strings:
            for argv in _spellings(option, value):
                if _reads_as(parser, argv, action.dest):
                    checked += 1
                    assert _refused(argv[0]), (argv, action.dest)
    assert checked > 300  # aliases, underscores, prefixes and =value forms were all tried


def test_every_other_vllm_flag_passes(parser):
    others = [s for a in parser._actions if a.dest not in RESERVED_DESTS for s in a.option_strings]
    assert len(others) > 100
    for option in others:
        if option in ("-h", "--help"):
            continue
        assert not _refused(option), option
        assert not _refused(f"{option}=1"), option
    for value in ("4", "org/model", "auto", "'{\"a\": 1}'"):  # values of other flags
        assert not _refused(value)


@pytest.mark.parametrize(
    "arg",
    ["-tp", "-pp=2", "-dp", "--tensor_parallel_size=2", "--tensor-par", "-t", "-qawq", "--config"],
)
def test_operator_names_the_spelling_and_the_reason(arg):
    with pytest.raises(SpecError, match=re.escape(arg) + ".*aliases, underscores"):
        load_model(minimal(engine={"extraArgs": [arg, "2"]}))


def test_negative_control_the_old_pattern_lets_aliases_through(parser):
    old = r"^--(tensor-parallel-size|pipeline-parallel-size)(=.*)?$"
    leaked = [a for a in ("-tp", "--tensor_parallel_size", "-dp") if not re.match(old, a)]
    assert leaked == ["-tp", "--tensor_parallel_size", "-dp"]
    assert all(
        _reads_as(parser, [a, "2"], d)
        for a, d in zip(
            leaked,
            ("tensor_parallel_size", "tensor_parallel_size", "data_parallel_size"),
            strict=True,
        )
    )


@pytest.mark.parametrize(
    "argv,tag",
    [
        (["org/other"], "org/other"),
        (["org/other", "--enable-prefix-caching"], "org/other"),
        (["--max-logprobs=4", "org/other"], "org/other"),
        (["--enable-prefix-caching", "--max-logprobs", "4"], None),
        (["--max-logprobs", "4", "--seed", "1"], None),
        (["--", "org/other"], "--"),
    ],
)
def test_a_bare_word_vllm_reads_as_the_model_is_refused(parser, argv, tag):
    """What vLLM's parser reads as its positional model tag (after the operator's own flags,
    which end with a value) is what the operator refuses; the CEL rule catches the first
    argument and `--`."""
    own = ["--model", "/models/m", "--dtype", "auto"]
    ns = parser.parse_args(own + argv)
    assert (ns.model_tag is not None) is (tag is not None)
    assert positional_arg(argv) == tag
    if tag is not None:
        with pytest.raises(SpecError, match="as the model to serve"):
            load_model(minimal(engine={"extraArgs": argv}))


def engine_tail(m) -> list[str]:
    """What the server hands vLLM: everything after `--` in the container's args."""
    args = desired_children(m)["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--") + 1 :] if "--" in args else []


def test_router_models_publish_kv_events_as_vllms_parser_reads_them(parser):
    """A router model's engine flags (builders/kvevents.py) as vLLM reads them."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.engine.arg_utils import EngineArgs

    router = {"router": {"enabled": True}}
    m = load_model(minimal(routing=router, engine={"extraArgs": ["--seed", "7"]}))
    ns = parser.parse_args(engine_tail(m))
    assert ns.enable_prefix_caching is True and ns.seed == 7  # the user's flags still pass
    config = EngineArgs.from_cli_args(ns).kv_events_config
    assert isinstance(config, KVEventsConfig)
    assert (config.enable_kv_cache_events, config.publisher) == (True, "zmq")
    # vLLM binds an endpoint with `*` and connects to any other: both must bind.
    assert config.endpoint == "tcp://*:5557" and config.replay_endpoint == "tcp://*:5558"
    # Negative controls: no events flags without the router, nor on the simulator.
    assert engine_tail(load_model(minimal())) == []
    sim = minimal(routing=router, engine={"backend": "simulator"})
    assert engine_tail(load_model(sim)) == []


@pytest.mark.parametrize("connector", ["nixl", "sharedStorage"])
def test_disaggregated_pools_kv_transfer_config_as_vllms_parser_and_config_read_it(
    parser, connector
):
    """Each pool's `--kv-transfer-config` (a server flag the server hands the engine,
    builders/disaggregation.py) with the pool's engine flags, through vLLM's own argument
    parser and into its KVTransferConfig; the connector named is one vLLM registers."""
    import dataclasses
    import json

    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs

    spec = {"type": connector}
    if connector == "sharedStorage":
        spec["sharedStorage"] = {"claimName": "kv-share"}
    body = minimal(
        routing={"router": {"enabled": True}},
        resources={"gpus": 2},
        parallelism={"tensor": 2},
        disaggregation={"connector": spec, "decode": {"gpus": 1, "tensor": 1}},
    )
    out = desired_children(load_model(body))
    for role, tp in (("prefill", 2), ("decode", 1)):
        (c,) = out[f"{role.capitalize()}Deployment"]["spec"]["template"]["spec"]["containers"]
        args = c["args"]
        value = args[args.index("--kv-transfer-config") + 1]
        tensor = args[args.index("--tensor-parallel-size") + 1]
        ns = parser.parse_args(
            ["--kv-transfer-config", value, "--tensor-parallel-size", tensor, *engine_tail_of(c)]
        )
        engine = EngineArgs.from_cli_args(ns)
        config = engine.kv_transfer_config
        assert isinstance(config, KVTransferConfig)
        assert engine.tensor_parallel_size == tp
        if connector == "nixl":  # vLLM deprecates kv_both with NIXL: one role per pool
            producer = role == "prefill"
            assert config.kv_role == ("kv_producer" if producer else "kv_consumer")
            assert (config.is_kv_producer, config.is_kv_consumer) == (producer, not producer)
        else:
            assert config.kv_role == "kv_both" and config.is_kv_producer and config.is_kv_consumer
        assert config.kv_connector in KVConnectorFactory._registry
        if connector == "nixl":
            assert config.kv_connector == "NixlConnector"
        else:
            assert config.kv_connector == "ExampleConnector"
            assert config.get_from_extra_config("shared_storage_path", None) == ("/mnt/kv-transfer")
        # vLLM's validation passes; each engine draws its own id (a pod's NIXL identity).
        direct = KVTransferConfig(**json.loads(value))
        assert direct.engine_id != config.engine_id
        assert dataclasses.replace(direct, engine_id=config.engine_id) == config
    # Negative control: vLLM's validation refuses what it does not know.
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_all")


def engine_tail_of(container) -> list[str]:
    args = container["args"]
    return args[args.index("--") + 1 :] if "--" in args else []
