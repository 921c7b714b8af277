"""Engine flags the operator sets from the spec, in every spelling vLLM's parser accepts.

`engine.extraArgs` reaches vLLM's own argument parser unchanged (after `--`), and a flag
there that the operator also derives from the spec would make the pod disagree with the
resource (two tensor-parallel sizes, another port). vLLM's parser
(`vllm.entrypoints.launchers.cli_args.make_arg_parser` on a `FlexibleArgumentParser`)
accepts more than `--name[=value]`:

- aliases (`-tp`, `-pp`, `-dp`, `-q`, `--device-memory-utilization`);
- underscores for dashes in long flags (`--tensor_parallel_size`, normalized by vLLM);
- any unambiguous prefix of a long or short flag (argparse's `allow_abbrev`: `--tensor-par`,
  `-t`), and a value glued to a two-character short flag (`-qawq`).

So a long flag is reserved when, with underscores read as dashes, it is a prefix of a
reserved long flag; a short flag when its name is a prefix of a reserved short flag, or it
starts with a reserved two-character one. `RESERVED_LONG`/`RESERVED_SHORT` are checked
against vLLM's parser by `tests/operator/test_operator_vllm_flags.py`: every spelling that
sets a reserved destination must be refused, every other vLLM flag accepted, so an alias
added in a vLLM release fails that test rather than production.

`--config FILE` is reserved too: vLLM reads the flags in that YAML file as if they were on
the command line, past every check here.

The operator's check (`reserved_flag`) and the CRD's CEL rule (`RESERVED_RE`) are made from
the same two tuples.

A bare word is vLLM's positional model tag (which model to serve) where it cannot be a
flag's value: first in `extraArgs` (the operator's own flags before it all end with their
value), right after a flag given as `--flag=value`, and after `--`. `positional_arg` refuses
those; CEL checks the first argument and `--`. A bare word after a bare value is not
checked (it may be the second value of a multi-value flag such as `--lora-modules`).
"""

from __future__ import annotations

# The server's own flags (`--engine`, `--api-key-file`) and the vLLM options the spec sets
# (`--scheduling-policy` follows server.queue.priorities).
RESERVED_LONG = (
    "--model",
    "--revision",
    "--served-model-name",
    "--host",
    "--port",
    "--engine",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--data-parallel-size",
    "--data-parallel-size-local",
    "--gpu-memory-utilization",
    "--device-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--swap-space",
    "--dtype",
    "--quantization",
    "--api-key",
    "--api-key-file",
    "--config",
    # LoRA: engine.lora and spec.adapters (the adapter list reaches the pods as a file).
    "--enable-lora",
    "--no-enable-lora",
    "--max-loras",
    "--max-lora-rank",
    "--max-cpu-loras",
    "--lora-modules",
    "--adapters-file",
    # Multi-node: spec.parallelism.nodes (the operator sets each node's rank and rendezvous).
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
    # Priority scheduling: server.queue.priorities.
    "--scheduling-policy",
)
RESERVED_SHORT = ("-tp", "-pp", "-dp", "-dpl", "-q", "-n", "-r")
# The vLLM settings (argparse destinations) behind them; the tests collect every option
# string vLLM's parser has for these and compare with the tuples above.
RESERVED_VLLM_DESTS = frozenset(
    {
        "model",
        "revision",
        "served_model_name",
        "host",
        "port",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "data_parallel_size_local",
        "gpu_memory_utilization",
        "max_model_len",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "headless",
        "max_num_seqs",
        "max_num_batched_tokens",
        "dtype",
        "quantization",
        "api_key",
        "config",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "lora_modules",
        "scheduling_policy",
    }
)
# Reserved but not vLLM's: the server's own flags, and --swap-space (engine.swapSpaceGiB).
RESERVED_NOT_VLLM = frozenset({"--engine", "--api-key-file", "--swap-space", "--adapters-file"})


def reserved_flag(arg: str) -> bool:
    """True when vLLM's parser could read `arg` as one of the reserved flags."""
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
        return len(name) > 2 and any(flag.startswith(name) for flag in RESERVED_LONG)
    if name.startswith("-") and len(name) > 1:
        glued = any(len(f) == 2 and arg.startswith(f) for f in RESERVED_SHORT)
        return glued or any(flag.startswith(name) for flag in RESERVED_SHORT)
    return False


def positional_arg(args: list[str]) -> str | None:
    """The first argument vLLM's parser would read as the positional model tag, or None."""
    complete = True  # the operator's flags before extraArgs end with their value
    for arg in args:
        if arg == "--":
            return arg  # everything after it is positional
        if arg.startswith("-"):
            complete = "=" in arg
        elif complete:
            return arg
        else:
            complete = False  # a flag's value; a further bare word may be a second value
    return None


def _prefix_re(text: str) -> str:
    """RE2 for any non-empty prefix of `text` ('-' also matching '_'): a(b(c)?)?."""
    head = "[-_]" if text[0] == "-" else text[0]
    return head if len(text) == 1 else f"{head}({_prefix_re(text[1:])})?"


def _cel_regex() -> str:
    longs = "|".join(_prefix_re(f[2:]) for f in RESERVED_LONG)
    shorts = "|".join(
        f[1] + (f"({_prefix_re(f[2:])})?" if len(f) > 2 else "") for f in RESERVED_SHORT
    )
    glued = "|".join(f for f in RESERVED_SHORT if len(f) == 2)
    # No backslashes: the pattern goes into a single-quoted CEL string as is.
    return f"^(--({longs})(=.*)?|-({shorts})(=.*)?|({glued}).*)$"


RESERVED_RE = _cel_regex()
