"""A vLLM plugin that lets the engine's processes use AMX on CPUs that have it.

On x86 CPUs with AMX (Sapphire Rapids and later), vLLM's CPU attention picks its AMX kernel
for bf16 (`vllm/v1/attention/backends/cpu_attn.py`, `_get_attn_isa`: AMX whenever
`torch.cpu._is_amx_tile_supported()`), but nothing in vLLM asks Linux for the AMX tile
state. Linux hands it out per process, on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and a
process started with exec (vLLM's engine core and workers) does not inherit it: the first
attention call then dies with SIGILL (the worker exits with -4 and the engine with
`EngineDeadError`). Whether something else asked first (oneDNN does when it runs an AMX
kernel of its own) depends on the engine's start-up path, so it crashes on some settings and
not others.

vLLM loads every `vllm.general_plugins` entry point in each of its processes, the workers
included (`vllm.plugins.load_general_plugins`), before the model runs: this one asks for
the tile state there (`torch.cpu._init_amx()`, the same request oneDNN makes). It does
nothing on CPUs without AMX, and on GPU images (the engine never runs the CPU kernel).
Registered in server/pyproject.toml.
"""

from __future__ import annotations


def request_amx() -> None:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
