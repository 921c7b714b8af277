"""The endpoint picker's reading rules (tests/server/epp_rules.py) on hand-written
expositions: what a pod must expose for an EPP to read the right numbers, and the failures
the engine test would catch (a gauge split per worker reads as one worker's share, a
doubled one reads double, a non-integer cache label is an error)."""

from __future__ import annotations

import pytest
from epp_rules import engine_type, extract, families, latest

GOOD = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4096"} 1.0
"""


def test_a_pod_that_exposes_each_gauge_once_reads_right():
    got = extract(GOOD)
    assert (got.running, got.waiting, got.kv_cache_usage) == (5, 2, 0.25)
    assert (got.block_size, got.num_gpu_blocks) == (16, 4096)
    assert got.errors == [] and got.active_adapters == set()  # no LoRA family: fine


def test_negative_control_a_gauge_split_per_worker_reads_one_share():
    split = GOOD.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny"} 5.0',
        'vllm:num_requests_running{engine="0",model_name="tiny",pid="11"} 2.0\n'
        'vllm:num_requests_running{engine="0",model_name="tiny",pid="12"} 3.0',
    )
    assert extract(split).running == 2  # the first series, not the pod's 5
    assert len(families(split)["vllm:num_requests_running"]) == 2


def test_the_latest_timestamp_wins_then_the_first():
    fams = families("a 1\na 2\nb 1 100\nb 2 200\nb 3 150\n")
    assert latest(fams, "a").value == 1 and latest(fams, "b").value == 2


def test_missing_family_and_bad_cache_labels_are_errors():
    got = extract(GOOD.replace('num_gpu_blocks="4096"', 'num_gpu_blocks="None"'))
    assert any("num_gpu_blocks" in e for e in got.errors)
    got = extract("\n".join(line for line in GOOD.splitlines() if "waiting" not in line))
    assert got.errors == ["metric family 'vllm:num_requests_waiting' not found"]


def test_lora_the_newest_series_by_value():
    lora = GOOD + (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} 100.0\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 200.0\n'
    )
    got = extract(lora)
    assert (got.active_adapters, got.waiting_adapters, got.max_adapters) == ({"a", "b"}, {"c"}, 4)


@pytest.mark.parametrize(("labels", "want"), [
    ({"llm-d.ai/engine-type": "vllm"}, "vllm"),
    ({"inference.networking.k8s.io/engine-type": "sglang"}, "sglang"),
    ({"llm-d.ai/engine-type": "vllm", "inference.networking.k8s.io/engine-type": "x"}, "vllm"),
    ({}, "default"),
])  # fmt: skip
def test_engine_type_label(labels, want):
    assert engine_type(labels) == want
