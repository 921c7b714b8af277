"""vLLM's environment settings are cached while an engine serves (its per-token front-end
path reads some) and read afresh once the last engine in the process has closed."""

from __future__ import annotations

import os

from sluice_server.engine.vllm_engine import _envs_cached
from vllm import envs


def test_settings_are_cached_while_an_engine_serves_and_fresh_after_the_last_closes(
    monkeypatch,
):
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "0")
    with _envs_cached():
        assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False
        os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"] = "1"
        assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False  # cached: no environ lookup
        with _envs_cached():  # a second engine opened and closed inside the first's life
            pass
        assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False  # still cached for the first
    assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is True  # the last engine closed: read afresh
