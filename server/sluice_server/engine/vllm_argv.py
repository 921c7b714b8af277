"""Our flags as vLLM's serve arguments: `vllm_cli_args` renders the argv (pure: settings in,
a list of strings out; no vLLM import).

`vllm_engine.parse_vllm_args` hands it to vLLM's own parser, for the engine this process
opens, for the engine core the pod's supervisor launches (`vllm_pod`) and for a worker node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..settings import Settings


def vllm_cli_args(settings: Settings, model_path: str, cpu_defaults: bool) -> list[str]:
    """Our flags rendered as vLLM serve arguments; `engine_args` come last and win."""
    args = ["--model", model_path, "--served-model-name", settings.model_label]
    if settings.revision:
        args += ["--revision", settings.revision]
    args += ["--tensor-parallel-size", str(settings.tensor_parallel_size)]
    args += ["--pipeline-parallel-size", str(settings.pipeline_parallel_size)]
    if settings.nnodes > 1:
        # vLLM's multiprocessing backend across nodes: every node runs the same arguments
        # with its own rank; the workers (rank > 0) are headless.
        args += ["--nnodes", str(settings.nnodes), "--node-rank", str(settings.node_rank)]
        args += ["--master-addr", str(settings.master_addr)]
        args += ["--master-port", str(settings.master_port)]
        if settings.headless:
            args += ["--headless"]
    args += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    args += ["--dtype", settings.dtype]
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "quantization"):
        value = getattr(settings, name)
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    if settings.swap_space is not None:
        # vLLM 0.32 has no --swap-space any more; its successor is CPU KV offloading (GiB).
        args += ["--kv-offloading-size", str(settings.swap_space)]
    if settings.lora_enabled:
        # Adapters are added and removed at run time (core/adapters.py), never listed here.
        args += ["--enable-lora"]
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(settings, name)
            if value is not None:
                args += ["--" + name.replace("_", "-"), str(value)]
    if settings.otlp_traces_endpoint:
        # The engine's own spans (queue, prefill, decode) join the request's trace.
        args += ["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
    if settings.priority_classes:
        # Fixed when the engine starts; each request then carries its caller's class.
        args += ["--scheduling-policy", "priority"]
    if settings.kv_transfer_config is not None:
        # Disaggregated serving: the connector that hands the prompt's KV cache over, and
        # usage that reports the prompt tokens it brought (`prompt_tokens_details`).
        args += ["--kv-transfer-config", settings.kv_transfer_config]
        args += ["--enable-prompt-tokens-details"]
    if cpu_defaults:
        # The CPU build misreads NUMA memory without an explicit KV size, and
        # torch.compile adds ~30 s to start-up for a model this small.
        args += ["--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20)]
    return args + list(settings.engine_args)
