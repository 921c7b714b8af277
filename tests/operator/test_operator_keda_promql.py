"""The ScaledObject's query, evaluated by the real Prometheus engine (`promtool test rules`):
one sample (KEDA needs a single element) equal to the sum of this model's per-pod TTFT
quantiles, idle and never-served pods counted as 0, other models' and namespaces' pods left
out. Skipped with one line without promtool (Debian package `prometheus`)."""

from __future__ import annotations

import subprocess

from operator_helpers import minimal
from sluice_operator.builders.keda import keda_query
from sluice_operator.validation import load_model
from testkit.promtool import run_tests

BUSY, IDLE, FRESH = "chat-5d8f7c9b6-b2k4p", "chat-5d8f7c9b6-x7z9q", "chat-6c7d8e9f0-fr3sh"
OTHER_MODEL = "chat-v2-5d8f7c9b6-b2k4p"  # a model named chat-v2: slow, must not count
# The busy pod: 10 streams per 15 s with TTFT in (0.05, 0.1] s and 5 in (0.1, 0.25] s;
# histogram_quantile interpolates inside the buckets.
EXPECTED_BUSY = {0.5: 0.0875, 0.75: 0.1375, 0.9: 0.205, 0.95: 0.2275, 0.99: 0.2455}


def _buckets(ns: str, pod: str, counts: dict[str, str]) -> list[tuple[str, str]]:
    return [
        (f'sluice_ttft_seconds_bucket{{namespace="{ns}",pod="{pod}",le="{le}"}}', v)
        for le, v in counts.items()
    ]


SERIES = [
    *_buckets(
        "llm", BUSY, {"0.05": "0+0x40", "0.1": "0+10x40", "0.25": "0+15x40", "+Inf": "0+15x40"}
    ),
    (f'sluice_ttft_seconds_count{{namespace="llm",pod="{BUSY}"}}', "0+15x40"),
    *_buckets("llm", IDLE, {"0.05": "7+0x40", "0.1": "7+0x40", "0.25": "7+0x40", "+Inf": "7+0x40"}),
    (f'sluice_ttft_seconds_count{{namespace="llm",pod="{IDLE}"}}', "7+0x40"),
    *_buckets("llm", OTHER_MODEL, {"1": "0+0x40", "2.5": "0+20x40", "+Inf": "0+20x40"}),
    (f'sluice_ttft_seconds_count{{namespace="llm",pod="{OTHER_MODEL}"}}', "0+20x40"),
    *_buckets("other", BUSY, {"1": "0+0x40", "2.5": "0+20x40", "+Inf": "0+20x40"}),
    (f'sluice_ttft_seconds_count{{namespace="other",pod="{BUSY}"}}', "0+20x40"),
    *[
        (f'up{{namespace="llm",pod="{p}",job="kubernetes-pods"}}', "1+0x40")
        for p in (BUSY, IDLE, FRESH, OTHER_MODEL)
    ],
]


def _query(percentile: float) -> str:
    body = minimal(autoscaling={"backend": "keda", "ttftPercentile": percentile})
    body["metadata"] = {"name": "chat", "namespace": "llm"}
    return keda_query(load_model(body))


def _promtool(tmp_path, cases: list[tuple[str, float]]) -> subprocess.CompletedProcess[str]:
    return run_tests(
        tmp_path,
        SERIES,
        what="KEDA query not evaluated",
        expr_cases=[
            {
                "expr": f"round({expr}, 0.0001)",
                "eval_time": "5m",
                # one sample, no labels: what KEDA's prometheus scaler needs
                "exp_samples": [{"labels": "{}", "value": value}],
            }
            for expr, value in cases
        ],
    )


def test_keda_query_sums_this_models_pods_with_idle_ones_at_zero(tmp_path):
    cases = [(_query(p), EXPECTED_BUSY[p] + 0 + 0) for p in EXPECTED_BUSY]
    proc = _promtool(tmp_path, cases)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_negative_control_a_namespace_only_matcher_lets_the_other_model_in(tmp_path):
    leaky = _query(0.9).replace(',pod=~"chat-[a-z0-9]+-[a-z0-9]+"', "")
    assert leaky != _query(0.9)
    proc = _promtool(tmp_path, [(leaky, EXPECTED_BUSY[0.9])])
    assert proc.returncode != 0
    assert (
        "2.555" in (proc.stdout + proc.stderr).split("got:")[1]
    )  # 0.205 + chat-v2's slow pod's 2.35 s
