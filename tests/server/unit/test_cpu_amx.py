"""The vLLM plugin that asks Linux for AMX in each engine process (engine/cpu_amx.py).

Without it, on a CPU with AMX, vLLM's CPU attention dies with SIGILL in the worker at the
first forward pass (every real-engine test fails with `EngineDeadError`)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

ARCH_GET_XCOMP_PERM = 0x1022
XFEATURE_XTILEDATA = 1 << 18


def test_registered_as_a_vllm_general_plugin():
    (plugin,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == "sluice_cpu_amx"
    ]
    from sluice_server.engine.cpu_amx import request_amx

    assert plugin.load() is request_amx


def _tile_permission_after(code: str) -> bool:
    """Whether a fresh process (as vLLM's workers are) holds AMX tile permission after `code`."""
    probe = (
        "import ctypes\n"
        f"{code}\n"
        "v = ctypes.c_ulong()\n"
        f"ctypes.CDLL(None).syscall(158, {ARCH_GET_XCOMP_PERM}, ctypes.byref(v))\n"
        "print(v.value)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return bool(int(out.stdout) & XFEATURE_XTILEDATA)


def test_asks_for_amx_where_the_cpu_has_it():
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: the plugin does nothing here")
    # A new process has no permission, even after torch says AMX is supported ...
    assert not _tile_permission_after("import torch; torch.cpu._is_amx_tile_supported()")
    # ... and has it once the plugin ran.
    assert _tile_permission_after(
        "from sluice_server.engine.cpu_amx import request_amx; request_amx()"
    )
