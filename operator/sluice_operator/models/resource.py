"""A validated StreamingModel as the builders see it: name, namespace, typed spec."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from .adapters import ADAPTER_NAME_IS_BASE
from .base import Rule
from .disaggregation import Role
from .spec import FORMER_DEFAULT_IMAGE, StreamingModelSpec

# The object's name becomes the Service's, so it must be a DNS-1035 label. On the CRD's root
# (generate/crd.py): `self` is the whole object there, and the operator checks the name.
DNS1035 = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = Rule(
    f"self.metadata.name.size() <= 63 && self.metadata.name.matches('{DNS1035}')",
    "metadata.name must be a DNS-1035 label (lower case letters, digits and '-', starting with a "
    "letter, at most 63 characters): it also names the Service",
    holds=lambda name: len(name) <= 63 and re.match(DNS1035, name) is not None,
    detail=lambda name: f"got {name!r}: rename the resource",
)
# The one adapter rule that needs the object's name (an unnamed non-hf base is served under
# it); the others are on the spec (models/adapters.py, ADAPTER_RULES). Also on the CRD's root;
# the operator's `holds` takes (name, parsed spec).
ADAPTER_NAME_RULE = Rule(
    "!has(self.spec.adapters) || has(self.spec.model.servedName) || "
    "self.spec.model.uri.startsWith('hf://') || "
    "self.spec.adapters.all(a, a.name != self.metadata.name)",
    ADAPTER_NAME_IS_BASE,
    holds=lambda obj: (
        obj[1].model.served_name is not None
        or obj[1].model.uri.startswith("hf://")
        or all(a.name != obj[0] for a in obj[1].adapters)
    ),
    field=".spec.adapters",
    detail=lambda obj: f"{obj[0]}, the object's name: rename the adapter or set model.servedName",
)

# A split names other StreamingModels; the object's own name is not one of them.
SPLIT_SELF_RULE = Rule(
    "!has(self.spec.routing) || !has(self.spec.routing.router) || "
    "!has(self.spec.routing.router.split) || "
    "self.spec.routing.router.split.all(v, v.model != self.metadata.name)",
    "spec.routing.router.split names the object itself: list the other versions only (this "
    "model keeps 100 minus their weights)",
    holds=lambda obj: all(v.model != obj[0] for v in obj[1].routing.router.split),
    field=".spec.routing.router.split",
)

# The chart's activator Service (release "sluice" in namespace "sluice-system").
DEFAULT_ACTIVATOR_HOST = "sluice-activator.sluice-system.svc.cluster.local"

# Where things live inside the server pod.
CACHE_DIR = "/cache"
MODEL_PVC_DIR = "/mnt/model"
API_KEYS_DIR = "/etc/sluice/auth"
API_KEYS_FILE = "api-keys"
JWKS_DIR = "/etc/sluice/jwks"
JWKS_FILE = "jwks.json"
ADAPTERS_DIR = "/etc/sluice/adapters"
ADAPTERS_FILE = "adapters.json"
ADAPTER_PVC_DIR = "/mnt/adapters"  # pvc:// adapters: each claim at ADAPTER_PVC_DIR/<claim>
WEIGHTS_DIR = "/mnt/weights"  # spec.model.cache.weights: the commit's folder, read-only
# On the StreamingModel: a new value downloads the revision again (a branch resolved anew,
# a failed download retried); its value joins the download Job's name (builders/weights.py).
WEIGHTS_REFRESH_ANNOTATION = "serving.sluice.dev/weights-refresh"


# The model image of an operator run without `--model-image` (and of `render`): the serving
# image of this release, as the operator chart's modelImage defaults to (a chart test keeps
# them equal).
DEFAULT_MODEL_IMAGE = "ghcr.io/sluice-dev/sluice-server:0.1.0"


@dataclass(frozen=True)
class OperatorDefaults:
    """What the operator's own configuration gives every model that does not choose for
    itself (`run --model-image`, the operator chart's `modelImage`)."""

    model_image: str = DEFAULT_MODEL_IMAGE
    # The router's master continuation key (docs/migration.md) as read for this pass from
    # `run --continuation-key-file`: each router model's own key is derived from it
    # (builders/continuation.py). None: no stream is migrated. Never in a repr (logs).
    continuation_key: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from, parsed from spec.model.uri."""

    kind: Literal["hf", "pvc", "path", "builtin"]
    model_arg: str  # what the server's --model gets
    revision: str | None = None
    claim: str | None = None  # pvc:// claim, mounted read-only at MODEL_PVC_DIR

    @property
    def default_served_name(self) -> str | None:
        return self.model_arg if self.kind == "hf" else None


def parse_model_uri(uri: str) -> ModelSource:
    if uri.startswith("hf://"):
        repo, _, revision = uri.removeprefix("hf://").partition("@")
        return ModelSource("hf", repo, revision=revision or None)
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        return ModelSource("pvc", f"{MODEL_PVC_DIR}/{path}".rstrip("/"), claim=claim)
    if uri.startswith("/"):
        return ModelSource("path", uri)
    return ModelSource("builtin", uri)


@dataclass(frozen=True)
class StreamingModel:
    """What every builder takes: identity plus the validated spec. No owner data: `kopf.adopt`
    adds owner references in the handler, so builders stay pure and testable offline.
    Made from an object by `validation.load_model`, which owns the readable errors."""

    name: str
    namespace: str
    spec: StreamingModelSpec
    # Not the spec: what a pass hands the builders about the cluster (scaletozero.py). Where
    # the operator's activator answers (its Service's name in the operator's namespace, from
    # `run --activator-service`), and whether the model's route goes there now (scale to
    # zero on, and no Ready replica). Offline renders see the defaults.
    activator_host: str = DEFAULT_ACTIVATOR_HOST
    via_activator: bool = False
    # Whether the operator chart runs the router (the activator: `run --activator-service`
    # set). Offline renders assume it does.
    router_available: bool = True
    # Not the spec either: the operator's configuration (`run --model-image`), which
    # `image` falls back to. Offline renders see the built-in default.
    defaults: OperatorDefaults = OperatorDefaults()
    # Not the spec: with spec.model.cache.weights, the commit whose files the pods mount
    # (weightsstate.py decides it from the status and the download Job); None: no commit is
    # ready, so no pods. And the object's WEIGHTS_REFRESH_ANNOTATION.
    weights_commit: str | None = None
    weights_refresh: str = ""
    # Not the spec: which pool of a disaggregated model (spec.disaggregation) this view
    # renders (`pool_view`); None: the model as a whole.
    role: Role | None = None

    @property
    def routed(self) -> bool:
        """The model opted into the router (spec.routing.router): the activator's models file
        lists it with its pods, and its `<name>-activator` Service exists."""
        return self.spec.routing.router.enabled

    @property
    def via_router(self) -> bool:
        """The route names the router: the model opted in and the operator chart runs it."""
        return self.routed and self.router_available

    @property
    def image(self) -> str:
        """The image the model's pods run: spec.image, or the operator's default when it is
        unset or holds FORMER_DEFAULT_IMAGE (what older CRDs stored for unset)."""
        chosen = self.spec.image
        if chosen is None or chosen == FORMER_DEFAULT_IMAGE:
            return self.defaults.model_image
        return chosen

    @property
    def source(self) -> ModelSource:
        return parse_model_uri(self.spec.model.uri)

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.source.default_served_name or self.name

    @property
    def simulated(self) -> bool:
        return self.spec.engine.backend == "simulator"

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on separate pools (spec.disaggregation)."""
        return self.spec.disaggregation is not None

    @property
    def multi_node(self) -> bool:
        """A replica is a group of pods on several nodes (a LeaderWorkerSet)."""
        return self.spec.parallelism.nodes > 1


def pool_view(model: StreamingModel, role: Role) -> StreamingModel:
    """One pool of a disaggregated model as the builders see it: the model with the pool's
    replicas, GPUs and tensor parallelism in place of the spec's, and no model-wide
    autoscaling (the pool's own autoscaler is builders/hpa.py's `desired_pool_hpa`)."""
    d = model.spec.disaggregation
    assert d is not None
    pool = d.pool(role)
    spec = model.spec
    resources = spec.resources.model_copy(update={"gpus": pool.gpus or spec.resources.gpus})
    parallelism = spec.parallelism.model_copy(
        update={"tensor": pool.tensor or spec.parallelism.tensor}
    )
    pooled = spec.model_copy(
        update={
            "replicas": pool.replicas,
            "resources": resources,
            "parallelism": parallelism,
            "autoscaling": None,
        }
    )
    return dataclasses.replace(model, spec=pooled, role=role)
