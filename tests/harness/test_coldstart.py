"""The cold-start table (e2e_harness/coldstart.py) from what a scale from zero recorded
(fixtures/coldstart/, from a run of tests/e2e/test_cold_start_live.py: the pod's JSON less
its managedFields, three families of its /metrics page, the times the test read): every
phase, in order, each from its source; each record compared within its resolution; a pod
whose record contradicts the order is reported (negative control)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from e2e_harness import coldstart

FIXTURES = Path(__file__).parent / "fixtures" / "coldstart"


@pytest.fixture
def recorded() -> tuple[dict, str, dict]:
    pod = json.loads((FIXTURES / "pod.json").read_text())
    page = (FIXTURES / "metrics.txt").read_text()
    times = json.loads((FIXTURES / "times.json").read_text())
    return pod, page, times


def _phases(pod: dict, page: str, times: dict, **over) -> list[coldstart.Phase]:
    kwargs = {"arrival": times["arrival"], "container": "server", "started": times["started"],
              "forwarded": times["forwarded"], "first_token": times["first_token"],
              "seen": times["seen"], **over}  # fmt: skip
    return coldstart.pod_phases(pod, page, **kwargs)


def test_every_phase_of_a_recorded_cold_start_in_order(recorded):
    pod, page, times = recorded
    phases = _phases(pod, page, times)
    assert [p.name for p in phases] == [p for p in coldstart.ORDER if p != "engine_imported"]
    assert coldstart.out_of_order(phases) == []
    at = dict(coldstart.since_arrival(phases))
    assert at["request_arrived"] == 0
    # The server's phases: its metric's seconds from the process's start.
    marks = coldstart.startup_metric(page)
    for name, seconds in marks.items():
        assert at[name] == pytest.approx(times["started"] - times["arrival"] + seconds)
    # Watched times replace the pod's whole seconds; the container's start stays one.
    by = {p.name: p for p in phases}
    assert by["pod_ready"].at == times["seen"]["pod_ready"] and not by["pod_ready"].whole_second
    assert by["container_started"].whole_second
    assert by["container_started"].at == coldstart.timestamp(
        pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    )
    table = coldstart.table("p", phases)
    assert table.count("\n") == len(phases) + 1 and "(1 s)" in table


def test_without_a_watch_or_the_process_start_the_pod_record_alone(recorded):
    """The pod's own timestamps (whole seconds) and the metric anchored at startedAt: still
    every phase, still in order at that resolution."""
    pod, page, times = recorded
    phases = _phases(pod, page, times, seen=None, started=None)
    by = {p.name: p for p in phases}
    assert by["pod_created"].at == coldstart.timestamp(pod["metadata"]["creationTimestamp"])
    assert all(by[n].whole_second for n in (*coldstart.KUBERNETES, "serving"))
    assert (
        by["serving"].at == by["container_started"].at + coldstart.startup_metric(page)["serving"]
    )
    assert coldstart.out_of_order(phases) == []


def test_a_record_against_the_order_is_reported(recorded):
    """Negative control: Ready two seconds before the container started (one would be within
    the whole seconds' resolution), a first token before the forward."""
    pod, page, times = recorded
    bad = copy.deepcopy(pod)
    started = coldstart.timestamp(
        bad["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    )
    for c in bad["status"]["conditions"]:
        if c["type"] == "Ready":
            c["lastTransitionTime"] = _rfc3339(started - 2)
    phases = _phases(bad, page, times, seen=None, first_token=times["forwarded"] - 0.01)
    found = coldstart.out_of_order(phases)
    assert ("container_started", "pod_ready") in found
    assert ("request_forwarded", "first_token") in found


def test_each_record_is_compared_within_its_resolution():
    """A whole-second 10 holds the truth in [10, 11): a precise 10.8 before it is in order,
    before a whole-second 9 it is not. A watch's time may be late by `SEEN_LAG`. Two precise
    times are compared as they are."""
    a = coldstart.Phase("scheduled", 10.8, "precise")

    def started(at: float, **kw) -> coldstart.Phase:
        return coldstart.Phase("container_started", at, "x", **kw)

    assert coldstart.out_of_order([a, started(10.0, late=1.0)]) == []
    assert coldstart.out_of_order([a, started(9.0, late=1.0)]) == [
        ("scheduled", "container_started")
    ]
    seen = coldstart.Phase("scheduled", 10.8, "watch", early=coldstart.SEEN_LAG)
    assert coldstart.out_of_order([seen, started(10.7)]) == []
    assert coldstart.out_of_order([a, started(10.7)]) == [("scheduled", "container_started")]


def test_the_logs_and_the_metric_page_are_read():
    activator = (
        "2026-12-05 02:50:01,100 INFO sluice_server.router.proxy ns/other forwarded after 1.000 s held\n"
        "2026-12-05 02:50:03,250 INFO sluice_server.router.proxy ns/cold forwarded after 2.125 s held\n"
        "2026-12-05 02:50:04,000 INFO sluice_server.router.proxy ns/cold timeout after 9.000 s held\n"
    )
    ((arrival, forwarded),) = coldstart.activator_forwards(activator, "ns/cold")
    assert forwarded == coldstart.log_time("2026-12-05 02:50:03,250")
    assert forwarded - arrival == pytest.approx(2.125)
    server = (
        "2026-12-05 02:50:00,000 INFO sluice_server something\n"
        "2026-12-05 02:50:02,500 INFO sluice_server start-up phases (seconds since the process "
        "started): process_started=0.00 imports_done=0.90 engine_ready=1.00 serving=1.50\n"
    )
    assert coldstart.process_start(server) == pytest.approx(
        coldstart.log_time("2026-12-05 02:50:01,000")
    )
    assert coldstart.process_start("nothing yet\n") is None
    page = (
        "# TYPE sluice_startup_phase_seconds gauge\n"
        'sluice_startup_phase_seconds{model="m",phase="serving"} 1.5\n'
        'sluice_startup_phase_seconds{model="m",phase="process_started"} 0.0\n'
        "# TYPE sluice_active_streams gauge\n"
        'sluice_active_streams{model="m"} 3.0\n'
    )
    assert list(coldstart.startup_metric(page).items()) == [
        ("process_started", 0.0),
        ("serving", 1.5),
    ]


def _rfc3339(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
