"""The Sluice server in each pod: the client protocols and streaming limits (`streaming`),
the request size limit (`limits`), its processes and admission queue (`server`)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator

from .base import ApiModel, Rule, sub

Protocol = Literal["sse", "websocket", "responses", "anthropic"]
ALL_PROTOCOLS: list[Protocol] = ["sse", "websocket", "responses", "anthropic"]


Origin = Annotated[str, StringConstraints(max_length=253, pattern=r"^(\*|https?://[^/\s,]+)$")]
HeaderName = Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z0-9-]+$")]


class CorsSpec(ApiModel):
    """Cross-origin access for browser pages on other origins (off when allowedOrigins is empty)."""

    allowed_origins: Annotated[list[Origin], Field(max_length=64)] = Field(
        default_factory=list,
        description="Origins whose pages may call the model (https://app.example.com, or * for any); "
        "WebSocket upgrades from other origins get 403. Empty: same origin only.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    allowed_headers: Annotated[list[HeaderName], Field(max_length=64)] | None = Field(
        default=None,
        description="Request headers such pages may send (default: Authorization, Content-Type, "
        "X-API-Key, Last-Event-ID).",
    )
    max_age_seconds: int = Field(
        default=600, ge=0, le=86400, description="How long browsers may cache a preflight answer."
    )


class ResumeSpec(ApiModel):
    """Resumable token streams: a dropped client may come back with Last-Event-ID."""

    grace_seconds: int = Field(
        default=0,
        ge=0,
        le=600,
        description="How long a token-SSE stream whose client dropped keeps generating, waiting "
        "for a reconnect with Last-Event-ID to the same pod (the Ingress gets cookie session "
        "affinity); the stream is lost if the pod goes. 0: abort at once.",
    )


class StreamingSpec(ApiModel):
    """Which streaming protocols are served and their limits."""

    protocols: Annotated[list[Protocol], Field(min_length=1, max_length=4)] = Field(
        default_factory=lambda: list(ALL_PROTOCOLS),
        description="Client APIs to serve, a non-empty subset of [sse, websocket, responses, "
        "anthropic]: sse covers the OpenAI chat, completions and models routes, /v1/stream, "
        "/tokenize, /detokenize and /version; websocket /ws/stream; responses the OpenAI "
        "Responses API (/v1/responses); anthropic the Anthropic Messages API (/v1/messages, "
        "/v1/messages/count_tokens). The others answer 404 naming this field.",
        json_schema_extra={"x-kubernetes-list-type": "set", "default": [*ALL_PROTOCOLS]},
    )
    heartbeat_seconds: int = Field(
        default=15,
        ge=1,
        le=300,
        description="Longest silence on a stream in seconds: an SSE comment goes to a stream idle that long (a long prefill), and the WebSocket ping interval.",
    )
    max_concurrent_streams: int = Field(
        default=256,
        ge=1,
        le=100000,
        description="Concurrent streams per replica; more get 429 with Retry-After.",
    )
    stream_timeout_seconds: int = Field(
        default=600,
        ge=1,
        le=86400,
        description="Longest a single stream may last. Pods get at least this long to drain on shutdown, "
        "and the ingress read/send timeouts are at least this.",
    )
    cors: CorsSpec = sub(CorsSpec, "Cross-origin access for browser pages (CORS); off by default.")
    resume: ResumeSpec = sub(ResumeSpec, "Resumable token streams; off by default.")
    playground: bool = Field(
        default=True,
        description="Serve the browser playground (<url>/playground), a page to try the model.",
    )

    @field_validator("protocols")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("protocols must not repeat an entry")
        return v


DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20


class LimitsSpec(ApiModel):
    """Request limits, applied alike by the server and the proxy in front of it."""

    max_request_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=2**30,
        description="Largest request body (and WebSocket frame) in bytes; default 16 MiB "
        "(16777216). Sets the server's --max-body-bytes, the Ingress's body-size annotation "
        "(proxy-body-size or client-max-body-size) and, with spec.gateway, is the limit the "
        "server enforces behind the route (Gateway API has no body-size field).",
    )


# Priority class and tenant names: the server's grammar (sluice_server/names.py), as RE2.
PRIORITY_PATTERN = r"^[a-z][a-z0-9-]{0,30}$"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
PriorityName = Annotated[str, StringConstraints(pattern=PRIORITY_PATTERN)]

QUEUE_NEEDS_SIZE = (
    "server.queue needs size: a queue is always bounded (at most that many requests wait per "
    "pod; past it they get 429 with Retry-After at once)"
)
QUEUE_DEFAULT_IS_A_CLASS = "server.queue.defaultPriority must be one of server.queue.priorities"
QUEUE_WEIGHTS = (
    "server.queue.tenantWeights: every weight is a whole number from 1 to 1000 (a tenant "
    "without one weighs 1)"
)


class QueueSpec(ApiModel):
    """The admission queue: a request that finds every stream slot of the pod taken waits,
    instead of an instant 429, served by priority class, then by tenant weight."""

    RULES = (
        Rule(
            "has(self.size)",
            QUEUE_NEEDS_SIZE,
            holds=lambda q: q.size is not None,
            field=".size",
        ),
        Rule(
            "!has(self.defaultPriority) || (has(self.priorities) && "
            "self.defaultPriority in self.priorities)",
            QUEUE_DEFAULT_IS_A_CLASS,
            holds=lambda q: q.default_priority is None or q.default_priority in q.priorities,
            field=".defaultPriority",
            detail=lambda q: f"got {q.default_priority!r}; priorities: {q.priorities}",
        ),
        # Values only: a map's keys have no length bound for CEL's cost estimate (the
        # operator checks the names, `_tenants`).
        Rule(
            "!has(self.tenantWeights) || self.tenantWeights.all(t, "
            "self.tenantWeights[t] >= 1 && self.tenantWeights[t] <= 1000)",
            QUEUE_WEIGHTS,
            holds=lambda q: all(1 <= w <= 1000 for w in q.tenant_weights.values()),
            field=".tenantWeights",
            detail=lambda q: ", ".join(
                f"{t}: {w}" for t, w in q.tenant_weights.items() if not 1 <= w <= 1000
            ),
        ),
    )

    size: int | None = Field(
        default=None,
        ge=1,
        le=100000,
        description="Requests per pod that may wait for a stream slot (required: a queue is "
        "always bounded). Past it: 429 with a Retry-After from the queue's measured drain "
        "rate, at once, the lowest priority shed first.",
    )
    timeout_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description="Longest wait in the queue; then 429 with Retry-After (or, for a stream "
        "that already got its 200 after a heartbeat of waiting, its protocol's error event "
        "with code queue_timeout).",
    )
    priorities: Annotated[list[PriorityName], Field(max_length=16)] = Field(
        default_factory=list,
        description="Priority classes, highest first (e.g. [interactive, batch]). A caller's "
        "class comes from its API key line (priority=CLASS) or its JWT (auth.jwt."
        "priorityClaim); higher classes are served first and shed last, and vLLM runs with "
        "--scheduling-policy priority. A key file naming another class is refused by the "
        "server. Empty: one class.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    default_priority: PriorityName | None = Field(
        default=None,
        description="Class of a caller that names none; default: the last (lowest) of priorities.",
    )
    tenant_weights: Annotated[dict[str, int], Field(max_length=256)] = Field(
        default_factory=dict,
        description="Tenants' weights (1-1000, default 1): a tenant's share of the pod, in "
        "generated tokens and in slots, against the other active tenants'. A key line's "
        "weight=N says the same for its tenant (the two must agree).",
    )
    slot_sharing: bool = Field(
        default=True,
        description="A tenant takes more than its weighted share of the slots only while "
        "slots stay free for every other active tenant below its share (as many as that "
        "tenant held at once lately, at least one, at most a quarter of the slots in all); "
        "false: slots go to the queue's order alone.",
    )
    fair_share_window_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="How long a tenant counts as active after its last request, for the "
        "slot shares.",
    )

    @field_validator("priorities")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("server.queue.priorities must not repeat a class")
        return v

    @field_validator("tenant_weights")
    @classmethod
    def _tenants(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [t for t in v if not re.match(TENANT_PATTERN, t)]
        if bad:
            raise ValueError(
                f"server.queue.tenantWeights: tenant names match {TENANT_PATTERN}; "
                f"not a plain name: {', '.join(bad)}"
            )
        return v


class ServerSpec(ApiModel):
    """The streaming server's own processes."""

    api_workers: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Front-end processes per pod (the server's --api-workers), sharing the "
        "port and one engine; stream slots, rate limits, /metrics and /ready stay the pod's. "
        "Unset: derived from resources.requests.cpu, one per whole core beyond the one "
        "vLLM's engine core busy-polls (max(1, cores - 1)), at most 8; no CPU request, "
        "streaming.resume on (a resumed stream lives in one process) or parallelism.nodes "
        "above 1 (the leader runs one process): 1.",
    )
    queue: QueueSpec | None = Field(
        default=None,
        description="Admission queue with priority classes and tenant weights, shared by "
        "every API worker of a pod; unset: a full pod answers 429 at once.",
    )


# Rules on the whole spec (StreamingModelSpec.RULES): API workers against resumable
# streams and multi-node replicas, which keep a stream or the engine in one process.
ONE_WORKER_WITH_RESUME = Rule(
    "!has(self.server) || !has(self.server.apiWorkers) || self.server.apiWorkers "
    "== 1 || !has(self.streaming) || !has(self.streaming.resume) || "
    "!has(self.streaming.resume.graceSeconds) || "
    "self.streaming.resume.graceSeconds == 0",
    "server.apiWorkers above 1 cannot be combined with streaming.resume.graceSeconds: a "
    "resumable stream lives in one server process and a reconnect may reach another; "
    "leave apiWorkers unset (resume makes it 1) or set it to 1, or turn resume off",
    holds=lambda s: (s.server.api_workers or 1) <= 1 or not s.streaming.resume.grace_seconds,
    field=".server.apiWorkers",
)
ONE_WORKER_ON_NODES = Rule(
    "!has(self.parallelism.nodes) || self.parallelism.nodes == 1 || "
    "!has(self.server) || !has(self.server.apiWorkers) || self.server.apiWorkers == 1",
    "server.apiWorkers above 1 cannot be combined with parallelism.nodes above 1: a "
    "multi-node leader runs one server process with the engine in it; leave apiWorkers "
    "unset (nodes above 1 make it 1) or set it to 1",
    holds=lambda s: s.parallelism.nodes == 1 or (s.server.api_workers or 1) <= 1,
    field=".server.apiWorkers",
)
