"""A cold start's phases for one pod, in order, as seconds since the request that woke the
model arrived (docs/autoscaling.md, "Cold start, phase by phase").

What each phase is read from:

| phase | read from |
|---|---|
| `request_arrived` | the activator's log: `<ns>/<model> forwarded after <s> s held`, the line's time minus the hold |
| `pod_created` | `metadata.creationTimestamp` |
| `scheduled` | condition `PodScheduled`'s `lastTransitionTime` |
| `container_started` | `containerStatuses[].state.running.startedAt` (the server's container) |
| `process_started` ... `serving` | `sluice_startup_phase_seconds{phase}` on the pod's `/metrics`: seconds since the process started, anchored at the process's start (the server's `start-up phases` log line: its time minus `serving`), else at `startedAt` |
| `pod_ready` | condition `Ready`'s `lastTransitionTime` |
| `request_forwarded` | the activator's log line's own time |
| `first_token` | the client's first token event |

Each phase is a time `at` and how far the truth may lie from it, `[at - early, at + late]`:
Kubernetes writes its timestamps in whole seconds (RFC 3339 without a fraction), so such a
phase lies in `[at, at + 1)`; `seen` replaces one by the moment a watch of the pod saw it
(sub-second, at most `SEEN_LAG` after the truth), as the operator's informer or a test sees
it; the server's phases count from the process's start in clock ticks (`TICK`). Two phases
are out of order only when the earlier one's earliest possible time is after the later
one's latest, so a true order is never reported as broken.

Pure: pod JSON (the API's camelCase, as `kubectl get pod -o json` or the client's
`sanitize_for_serialization`), a metrics page and log texts in, phases out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from prometheus_client.parser import text_string_to_metric_families

SERVER_PHASES = (  # sluice_server/startup.py's PHASES, in start-up order
    "process_started",
    "imports_done",
    "weights_located",
    "engine_imported",
    "engine_ready",
    "serving",
)
ORDER = (
    "request_arrived",
    "pod_created",
    "scheduled",
    "container_started",
    *SERVER_PHASES,
    "pod_ready",
    "request_forwarded",
    "first_token",
)
KUBERNETES = ("pod_created", "scheduled", "container_started", "pod_ready")

_LOG_TIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_PHASES_LINE = re.compile(
    _LOG_TIME + r" .*start-up phases \(seconds since the process started\): (.*)$", re.M
)


SEEN_LAG = 0.25  # a watch's delivery on a local API server: milliseconds, with room
TICK = 0.01  # the kernel's process start time, in clock ticks (SC_CLK_TCK, 100 on Linux)


@dataclass(frozen=True)
class Phase:
    name: str
    at: float  # seconds since the epoch
    source: str  # where it was read
    early: float = 0.0  # the truth lies in [at - early, at + late]
    late: float = 0.0

    @property
    def whole_second(self) -> bool:
        """A Kubernetes timestamp (or counted from one): the truth up to 1 s later."""
        return self.late >= 1.0


def timestamp(value: str) -> float:
    """An RFC 3339 time (`2026-12-05T02:50:01Z`, `...+00:00`, with or without a fraction)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def log_time(value: str) -> float:
    """A Python log line's `%(asctime)s` (`2026-12-05 02:50:01,123`), in local time."""
    return datetime.strptime(value, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def startup_metric(page: str) -> dict[str, float]:
    """`sluice_startup_phase_seconds` by phase from a Prometheus text page, in start-up order."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        if family.name == "sluice_startup_phase_seconds":
            for s in family.samples:
                found[s.labels["phase"]] = s.value
    return {p: found[p] for p in SERVER_PHASES if p in found}


def process_start(server_log: str) -> float | None:
    """The server process's start from its `start-up phases` log line (the line's time
    minus its `serving`); None when it has not logged it."""
    m = _PHASES_LINE.search(server_log)
    if m is None:
        return None
    marks = dict(kv.split("=", 1) for kv in m.group(2).split())
    return log_time(m.group(1)) - float(marks["serving"])


def activator_forwards(activator_log: str, model: str) -> list[tuple[float, float]]:
    """(arrival, forwarded) of each request the activator held for `model` (`ns/name`) and
    then forwarded, from its log lines `<ns>/<name> forwarded after <s> s held`."""
    line = re.compile(_LOG_TIME + r" .*" + re.escape(model) + r" forwarded after ([0-9.]+) s held")
    return [(log_time(t) - float(s), log_time(t)) for t, s in line.findall(activator_log)]


def _condition(pod: dict, kind: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return c.get("lastTransitionTime")
    return None


def _started(pod: dict, container: str | None) -> str | None:
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        if container in (None, c.get("name")):
            return ((c.get("state") or {}).get("running") or {}).get("startedAt")
    return None


def pod_phases(
    pod: dict,
    metrics: str,
    *,
    arrival: float,
    container: str | None = None,
    started: float | None = None,
    forwarded: float | None = None,
    first_token: float | None = None,
    seen: Mapping[str, float] | None = None,
) -> list[Phase]:
    """The phases one pod passed, in `ORDER` (a phase with no record is absent).

    `arrival`, `forwarded`, `first_token`: the request's own times (the activator's log,
    the client). `container`: the server's container (the first one when None). `started`:
    the server process's start (`process_start`), which anchors the metric's phases; the
    container's `startedAt` when None. `seen`: sub-second times a watch saw any of
    `KUBERNETES`, used instead of the pod's whole-second timestamps."""
    seen = seen or {}
    found = [Phase("request_arrived", arrival, "the activator's log: line time - hold")]
    recorded = {
        "pod_created": (pod["metadata"].get("creationTimestamp"), "metadata.creationTimestamp"),
        "scheduled": (_condition(pod, "PodScheduled"), "condition PodScheduled"),
        "container_started": (_started(pod, container), "state.running.startedAt"),
        "pod_ready": (_condition(pod, "Ready"), "condition Ready"),
    }
    kube: dict[str, Phase] = {}
    for name, (value, source) in recorded.items():
        if name in seen:
            kube[name] = Phase(name, seen[name], f"a watch of the pod ({source})", early=SEEN_LAG)
        elif value is not None:
            kube[name] = Phase(name, timestamp(value), source, late=1.0)
    found += [kube[n] for n in ("pod_created", "scheduled", "container_started") if n in kube]
    marks = startup_metric(metrics)
    origin = kube.get("container_started")
    if started is not None:
        origin = Phase("", started, "the process's start", early=TICK, late=TICK)
    if origin is not None:
        for name, seconds in marks.items():
            found.append(
                Phase(
                    name,
                    origin.at + seconds,
                    f"sluice_startup_phase_seconds + {origin.source}",
                    early=origin.early,
                    late=origin.late,
                )
            )
    if "pod_ready" in kube:
        found.append(kube["pod_ready"])
    if forwarded is not None:
        found.append(Phase("request_forwarded", forwarded, "the activator's log: line time"))
    if first_token is not None:
        found.append(Phase("first_token", first_token, "the client's first token event"))
    return found


def out_of_order(phases: list[Phase]) -> list[tuple[str, str]]:
    """Pairs (earlier, later) in `ORDER` whose records say the opposite: the earlier one's
    earliest possible time after the later one's latest."""
    rank = {n: i for i, n in enumerate(ORDER)}
    ranked = sorted(phases, key=lambda p: rank[p.name])
    return [(a.name, b.name) for i, a in enumerate(ranked) for b in ranked[i + 1 :]
            if a.at - a.early > b.at + b.late]  # fmt: skip


def since_arrival(phases: list[Phase]) -> list[tuple[str, float]]:
    """(phase, seconds since `request_arrived`) in the order given."""
    (t0,) = [p.at for p in phases if p.name == "request_arrived"]
    return [(p.name, p.at - t0) for p in phases]


def table(pod: str, phases: list[Phase]) -> str:
    """A Markdown table of one pod's phases: seconds since arrival, since the phase before,
    and the source (a whole-second Kubernetes timestamp marked `(1 s)`: the truth up to a
    second later)."""
    rows = [
        f"| phase ({pod}) | s since arrival | s since previous | read from |",
        "|---|---:|---:|---|",
    ]
    prev = None
    for p, (name, s) in zip(phases, since_arrival(phases), strict=True):
        step = "" if prev is None else f"{s - prev:.3f}"
        rows.append(
            f"| {name} | {s:.3f} | {step} | {p.source}{' (1 s)' if p.whole_second else ''} |"
        )
        prev = s
    return "\n".join(rows)
