"""vLLM's environment settings are cached while an engine serves (its per-token front-end
path reads some) and read afresh once the last engine in the process has closed."""

from __future__ import annotations

from sluice_server.engine import vllm_engine
from sluice_server.engine.vllm_engine import _envs_cached
from vllm import envs

NAME = "VLLM_COMPUTE_NANS_IN_LOGITS"


def test_settings_are_cached_while_an_engine_serves_and_fresh_after_the_last_closes(
    monkeypatch,
):
    # As if no engine were open in this process (the session's may be: its cache is put
    # back as it was at the end).
    monkeypatch.setattr(vllm_engine, "_engines_open", 0)
    was_on = hasattr(envs.__getattr__, "cache_clear")
    envs.disable_envs_cache()
    try:
        monkeypatch.setenv(NAME, "0")
        with _envs_cached():
            assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False
            monkeypatch.setenv(NAME, "1")
            assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False  # cached: no environ lookup
            with _envs_cached():  # a second engine opened and closed inside the first's life
                pass
            assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False  # still cached for the first
        assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is True  # the last engine closed: read afresh
    finally:
        monkeypatch.delenv(NAME)
        if was_on:
            envs.enable_envs_cache()
