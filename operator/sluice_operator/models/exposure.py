"""How clients reach the model: an Ingress (`ingress`) or a Gateway API HTTPRoute
(`gateway`), balancing over the replicas, the InferencePool and the Sluice router
(`routing`), and the NetworkPolicy that admits traffic to the pods (`networkPolicy`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from .base import ApiModel, Rule, sub
from .refs import Name

# nginx's size syntax (client_max_body_size): bytes, or k/m/g (binary multiples).
NGINX_SIZE_PATTERN = r"^[0-9]{1,10}[kKmMgG]?$"


def nginx_size_bytes(size: str) -> int:
    factor = {"k": 2**10, "m": 2**20, "g": 2**30}.get(size[-1].lower(), 1)
    return int(size.rstrip("kKmMgG")) * factor


class IngressSpec(ApiModel):
    """An Nginx Ingress with streaming-safe settings (buffering off, long timeouts)."""

    RULES = (
        Rule(
            "!has(self.tlsSecretName) || has(self.host)",
            "ingress.tlsSecretName needs ingress.host (the name on the certificate)",
            holds=lambda i: not i.tls_secret_name or bool(i.host),
            field=".tlsSecretName",
        ),
    )

    enabled: bool = Field(default=False, description="Create an Ingress.")
    class_name: Annotated[str, StringConstraints(max_length=253)] = Field(
        default="nginx", description="IngressClass name (spec.ingressClassName of the Ingress)."
    )
    controller: Literal["auto", "ingress-nginx", "f5-nginx"] = Field(
        default="auto",
        description="Which controller serves className, which decides the annotation set: ingress-nginx "
        "(community, nginx.ingress.kubernetes.io/*) or f5-nginx (F5 NGINX Ingress Controller, nginx.org/*). "
        "auto: f5-nginx when className contains nginx-org, nginx-plus or f5, else ingress-nginx "
        "(both controllers default to the class name nginx, so set this when you run F5's).",
    )
    host: (
        Annotated[
            str,
            StringConstraints(max_length=253, pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
        ]
        | None
    ) = Field(default=None, description="Host name; unset matches every host.")
    path: Annotated[
        str, StringConstraints(max_length=1024, pattern=r"^(/[A-Za-z0-9._~-]+)*/?$")
    ] = Field(
        default="/",
        description="Path prefix (/mistral): the Ingress routes it unchanged and the server is "
        "told (--root-path), so the model answers at <prefix>/v1/... with no rewrite annotations.",
    )
    tls_secret_name: Name | None = Field(
        default=None, description="Secret with the TLS certificate for host; unset: plain HTTP."
    )
    max_body_size: (
        Annotated[str, StringConstraints(max_length=32, pattern=NGINX_SIZE_PATTERN)] | None
    ) = Field(
        default=None,
        description="Deprecated: set spec.limits.maxRequestBytes, which sets the server's limit "
        "and the ingress's together. Still honoured (nginx size, e.g. 16m) when "
        "limits.maxRequestBytes is unset.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Extra Ingress annotations, merged over the operator's (yours win).",
    )


Hostname = Annotated[
    str, StringConstraints(max_length=253, pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]


class ParentReference(ApiModel):
    """A Gateway (or one of its listeners) the route attaches to."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        description="Gateway name."
    )
    namespace: Name | None = Field(
        default=None,
        description="Gateway namespace; the StreamingModel's when unset (the Gateway's "
        "listener must allow routes from it: allowedRoutes.namespaces).",
    )
    section_name: Name | None = Field(
        default=None, description="Listener name on the Gateway; every listener when unset."
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="Listener port.")


class GatewaySpec(ApiModel):
    """A Gateway API HTTPRoute (gateway.networking.k8s.io/v1) instead of an Ingress."""

    parent_refs: Annotated[list[ParentReference], Field(min_length=1, max_length=32)] = Field(
        description="Gateways the route attaches to (Gateway API parentRefs)."
    )
    hostnames: Annotated[list[Hostname], Field(max_length=16)] = Field(
        default_factory=list,
        description="Host names the route answers; every host the listener accepts when empty. "
        "The first one is the status URL's host.",
    )
    path: Annotated[str, StringConstraints(max_length=1024, pattern=r"^/")] = Field(
        default="/",
        description="Path prefix (PathPrefix match): passed to the server unchanged and the "
        "server is told (--root-path), as with the Ingress, so the model answers at <prefix>/v1/....",
    )
    scheme: Literal["http", "https"] = Field(
        default="http",
        description="Protocol of the Gateway listener, for the status URL (TLS is the "
        "Gateway's, not the route's).",
    )
    session_persistence: bool = Field(
        default=False,
        description="With streaming.resume.graceSeconds > 0, pin each client to its pod with a "
        "session cookie (sluice-affinity) on the route's rule, so a resumed stream reaches "
        "the pod that kept it (rules[].sessionPersistence). That field is in the "
        "Experimental channel of Gateway API v1.x, not the Standard one: turn this on only "
        "where the Experimental HTTPRoute CRD is installed and the implementation supports "
        "cookie session persistence. With the Standard CRD the route is applied without it "
        "and condition GatewayRoute is False (SessionPersistenceDropped).",
    )


class EndpointPickerPort(ApiModel):
    """A port of the endpoint picker's Service."""

    number: int = Field(
        ge=1,
        le=65535,
        description="Port number (the EPP's ext-proc gRPC port, 9002 in GAIE's charts).",
    )


class EndpointPickerRef(ApiModel):
    """The endpoint picker (EPP) the gateway asks which pod serves each request."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        description="Name of the endpoint picker's Service, in the model's namespace (the "
        "platform team runs the EPP, e.g. llm-d-router's or GAIE's chart)."
    )
    port: EndpointPickerPort = Field(description="The EPP Service's ext-proc port.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the EPP does not answer: FailClose refuses "
        "the request (503), FailOpen sends it to a pod of the pool its own way.",
    )


class InferencePoolSpec(ApiModel):
    """A Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1)."""

    enabled: bool = Field(
        default=False,
        description="Create an InferencePool named like the model that selects its pods; "
        "with spec.gateway, the HTTPRoute's backend is the pool instead of the Service, so "
        "the gateway asks the endpoint picker which pod takes each request.",
    )
    app_protocol: Literal["http", "kubernetes.io/h2c"] = Field(
        default="http",
        description="Protocol the gateway speaks to the pods. The Sluice server speaks "
        "HTTP/1.1 (uvicorn has no HTTP/2): keep http unless the image serves HTTP/2 in "
        "cleartext (kubernetes.io/h2c).",
    )
    endpoint_picker: EndpointPickerRef | None = Field(
        default=None,
        description="The pool's endpointPickerRef. Unset: the pool carries none (optional "
        "in GAIE v1.6.0's CRD) and the gateway implementation picks the endpoint its own way.",
    )


class MigrationSpec(ApiModel):
    """Streams that outlive their pod (docs/migration.md): the router continues a stream
    whose pod went away on another Ready replica."""

    enabled: bool = Field(
        default=True,
        description="Continue a stream the router relays on another Ready replica when its "
        "pod goes away mid-answer (killed, drained, its node lost, or silent for "
        "stallSeconds), from the last token the client received: the client sees one "
        "stream. Needs the operator's continuation key (the sluice-operator chart gives it "
        "one with the router): the operator then writes the model's key to the Secret "
        "<name>-continuation-key, which the pods mount (condition StreamMigration says "
        "whether streams migrate, and why not). false: a stream ends with its pod, and the "
        "pods get no key.",
    )
    max_migrations: int = Field(
        default=3,
        ge=0,
        le=10,
        description="How many times one stream may be moved to another replica; past it "
        "the stream ends with its protocol's error event.",
    )
    stall_seconds: float = Field(
        default=30,
        ge=1,
        le=3600,
        description="An upstream stream that sends no byte for this long counts as broken "
        "(a partitioned node sends nothing) and is continued elsewhere. Pods send a "
        "keep-alive on a silent stream every streaming.heartbeatSeconds, so this must be "
        "greater than that.",
    )


MAX_SPLIT_VERSIONS = 8


class SplitVersion(ApiModel):
    """Another StreamingModel that takes a share of this model's conversations."""

    model: Name = Field(
        description="Name of the StreamingModel in the same namespace (the other version). "
        "It must use the router (its spec.routing.router.enabled), serve the same public "
        "model name (model.servedName) and claim no host and path of this model's route."
    )
    weight: int = Field(
        ge=0,
        le=100,
        description="Percent of conversations it takes (0: none, e.g. right after a roll "
        "back); this model keeps 100 minus the sum of the weights.",
    )


def _split_sum(split: list[SplitVersion]) -> int:
    return sum(v.weight for v in split)


def _split_twice(split: list[SplitVersion]) -> list[str]:
    names = [v.model for v in split]
    return sorted({n for n in names if names.count(n) > 1})


SPLIT_RULES = (
    Rule(
        "!has(self.split) || self.split.map(v, v.weight).sum() <= 100",
        "routing.router.split: the weights must sum to at most 100 (this model keeps 100 "
        "minus the sum)",
        holds=lambda r: _split_sum(r.split) <= 100,
        field=".split",
        detail=lambda r: f"they sum to {_split_sum(r.split)}: lower them",
    ),
    Rule(
        "!has(self.split) || self.split.all(v, self.split.filter(w, w.model == v.model).size() == 1)",
        "routing.router.split: each model may appear once",
        holds=lambda r: not _split_twice(r.split),
        field=".split",
        detail=lambda r: f"{', '.join(_split_twice(r.split))} appears more than once",
    ),
    Rule(
        "!has(self.split) || size(self.split) == 0 || (has(self.enabled) && self.enabled)",
        "routing.router.split needs routing.router.enabled: the router chooses the version "
        "for each conversation, so a split without it would never apply",
        holds=lambda r: not r.split or r.enabled,
        field=".split",
    ),
)


class RouterSpec(ApiModel):
    """The Sluice router: the operator chart's router (activator) pods pick the replica for
    each request."""

    RULES = SPLIT_RULES

    enabled: bool = Field(
        default=False,
        description="Send every request through the Sluice router (the operator chart's "
        "activator Deployment): the route names the router whatever the replica count, and "
        "the router watches the model's Ready pods and forwards each request to one of "
        "them (with no Ready pod it holds the request, as for scale to zero). The pods "
        "publish their KV-cache events on port 5557 for it. An alternative to "
        "inferencePool (an endpoint picker behind a Gateway). The route has one backend, "
        "the router, which applies balance itself (changing it rolls no pod). Needs the "
        "chart's activator.enabled: without "
        "it the route goes to the Service and condition RouterReady says so.",
    )
    migration: MigrationSpec = sub(
        MigrationSpec,
        "Streams that outlive their pod: continued on another replica (on by default).",
    )
    split: Annotated[list[SplitVersion], Field(max_length=MAX_SPLIT_VERSIONS)] = Field(
        default_factory=list,
        description="Other versions of this model (other StreamingModels of the namespace) "
        "and the percent of conversations each takes; this model keeps the rest and owns "
        "the public route (docs/versions.md). The router picks a version per conversation, "
        "sticky by its session key (the X-Sluice-Session header, the body's user or "
        "metadata.user_id, else the credential and the first turn), so a conversation stays "
        "on one version. Promote or roll back by changing a weight: streams in flight keep "
        "their version. A version that fails a check (condition TrafficSplit says which and "
        "why) takes no traffic: its share stays here. status.split shows each version's "
        "TTFT, error rate and tokens/s side by side.",
    )

    @property
    def migrates(self) -> bool:
        """The model asks for its streams to be continued elsewhere (the router on, and
        migration on)."""
        return self.enabled and self.migration.enabled


# The router and the InferencePool both choose the pod for each request: one or the other.
ROUTER_OR_POOL = Rule(
    # has(): the API server checks the rule on the node's default `{}` as written too.
    "!(has(self.router) && has(self.router.enabled) && self.router.enabled && "
    "has(self.inferencePool) && has(self.inferencePool.enabled) && self.inferencePool.enabled)",
    "routing.router.enabled and routing.inferencePool.enabled are exclusive: pick the pod "
    "for each request with the Sluice router or with the InferencePool's endpoint picker, "
    "not both (turn one of them off)",
    holds=lambda r: not (r.router.enabled and r.inference_pool.enabled),
    field=".router",
)


class RoutingSpec(ApiModel):
    """How requests are spread over the model's replicas."""

    RULES = (ROUTER_OR_POOL,)

    balance: Literal["least-loaded", "round-robin"] = Field(
        default="least-loaded",
        description="How the Ingress picks a replica for a new request. least-loaded: the "
        "controller's nearest load-aware method (F5 NGINX Ingress: nginx.org/lb-method "
        "least_conn, the replica with the fewest open streams; ingress-nginx has none that "
        "sees open streams, its ewma scores replicas by finished responses only, so it "
        "keeps round_robin). round-robin: each replica in turn. With "
        "streaming.resume.graceSeconds > 0 an affinity cookie still brings a client back "
        "to its pod. A Gateway API route has no balancing field: use inferencePool for "
        "load-aware routing behind a Gateway. With router.enabled the router applies it "
        "instead: least-loaded is its placement by prefix cache and load, round-robin "
        "each Ready pod in turn.",
    )
    inference_pool: InferencePoolSpec = sub(
        InferencePoolSpec, "InferencePool for an endpoint picker (off by default)."
    )
    router: RouterSpec = sub(
        RouterSpec, "The Sluice router, which places each request on a replica (off by default)."
    )


class NetworkPolicySpec(ApiModel):
    """A NetworkPolicy that admits traffic to the model pods only from where it should come."""

    enabled: bool = Field(
        default=False,
        description="Create a NetworkPolicy for the model pods: ingress to the server port only "
        "from the model's namespace, proxyNamespaces and monitoringNamespaces (egress is not "
        "restricted). Needs a CNI that enforces NetworkPolicy.",
    )
    proxy_namespaces: Annotated[list[Name], Field(max_length=16)] = Field(
        default_factory=lambda: ["ingress-nginx"],
        description="Namespaces of the ingress controller or Gateway data plane that proxies to "
        "the model (e.g. ingress-nginx, nginx-gateway, envoy-gateway-system, istio-system).",
    )
    monitoring_namespaces: Annotated[list[Name], Field(max_length=16)] = Field(
        default_factory=lambda: ["monitoring"],
        description="Namespaces of the Prometheus that scrapes /metrics (prometheus-adapter "
        "and KEDA read Prometheus, not the pods, so they need no entry).",
    )


# A rule on the whole spec (StreamingModelSpec.RULES): one way in.
GATEWAY_OR_INGRESS = Rule(
    "!has(self.gateway) || !self.ingress.enabled",
    "spec.gateway and spec.ingress.enabled are exclusive: expose the model "
    "through a Gateway (HTTPRoute) or an Ingress, not both",
    holds=lambda s: s.gateway is None or not s.ingress.enabled,
    field=".gateway",
)


# A pod writes a keep-alive to a silent stream every heartbeat: a stall shorter than that
# would take a healthy stream (a long prefill) for a broken one. A rule on the whole spec
# (StreamingModelSpec.RULES): the heartbeat is in spec.streaming. Only while the router
# migrates the model's streams; the defaults (15 s, 30 s) apply where a field is absent.
STALL_OVER_HEARTBEAT = Rule(
    "!has(self.routing) || !has(self.routing.router) || !has(self.routing.router.enabled) || "
    "!self.routing.router.enabled || !has(self.routing.router.migration) || "
    "(has(self.routing.router.migration.enabled) && !self.routing.router.migration.enabled) || "
    "double(has(self.routing.router.migration.stallSeconds) ? "
    "self.routing.router.migration.stallSeconds : 30.0) > "
    "double(has(self.streaming) && has(self.streaming.heartbeatSeconds) ? "
    "self.streaming.heartbeatSeconds : 15)",
    "routing.router.migration.stallSeconds must be greater than streaming.heartbeatSeconds: "
    "a pod sends a keep-alive on a silent stream every heartbeat, so a shorter stall would "
    "take a healthy stream (a long prefill) for a broken one; raise stallSeconds, lower "
    "heartbeatSeconds, or turn migration off",
    holds=lambda s: (
        not s.routing.router.migrates
        or s.routing.router.migration.stall_seconds > s.streaming.heartbeat_seconds
    ),
    field=".routing.router.migration.stallSeconds",
    detail=lambda s: (
        f"got stallSeconds {s.routing.router.migration.stall_seconds:g} and "
        f"heartbeatSeconds {s.streaming.heartbeat_seconds}"
    ),
)
