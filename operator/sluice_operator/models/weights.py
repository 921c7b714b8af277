"""The weights cache (`spec.model.cache.weights`): an hf:// model's weights downloaded once
by the operator into a ReadWriteMany PersistentVolumeClaim, and mounted read-only by every
pod of every model in the namespace that names the same claim (docs/weights-cache.md).

A mode of `spec.model.cache`, not a resource of its own: the claim *is* the shared object
(several models naming it share one copy, one download Job per repository and revision), so
a second kind would only repeat its name and size; the StreamingModel's status says how its
weights stand, where people already look.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from .base import ApiModel, Quantity, Rule
from .refs import Name

# The weights cache keeps files at <root>/<org>/<name>/<commit>: a repository without an
# organisation would have no directory of its own.
CACHED_URI_RE = r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$"
HUB_ENDPOINT_RE = r"^https?://[!-~]+$"


class WeightsVolume(ApiModel):
    """The PersistentVolumeClaim the operator creates when `claimName` does not exist."""

    size: Quantity = Field(
        description="Requested size: every revision kept at once (a revision change keeps the "
        "old one until the pods rolled), e.g. 2 x 140Gi for a 70B model in bf16."
    )
    storage_class_name: Name | None = Field(
        default=None,
        description="StorageClass of the claim; it must offer the access mode (ReadWriteMany: "
        "NFS, CephFS, Filestore, EFS, Azure Files, Lustre...). Unset: the cluster's default.",
    )
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        default="ReadWriteMany",
        description="ReadWriteMany (pods on any node). ReadWriteOnce only where every pod of "
        "the models sharing the claim and the download Job run on one node (a single-node "
        "pool): a pod on another node cannot attach the volume and stays ContainerCreating.",
    )


class WeightsCache(ApiModel):
    """Weights downloaded once by the operator into a shared claim; pods start offline."""

    RULES = (
        Rule(
            f"!has(self.hubEndpoint) || self.hubEndpoint.matches('{HUB_ENDPOINT_RE}')",
            "model.cache.weights.hubEndpoint must be an http:// or https:// URL (a Hugging Face "
            "Hub mirror, given to the download Job as HF_ENDPOINT)",
            holds=lambda w: (
                w.hub_endpoint is None or w.hub_endpoint.startswith(("http://", "https://"))
            ),
            field=".hubEndpoint",
            detail=lambda w: f"got {w.hub_endpoint!r}",
        ),
    )

    claim_name: Name = Field(
        description="PersistentVolumeClaim holding the weights (ReadWriteMany), shared by every "
        "StreamingModel of the namespace that names it: each repository and revision is "
        "downloaded into it once. Used as is when it exists; else created from `create`."
    )
    create: WeightsVolume | None = Field(
        default=None,
        description="Create the claim when it does not exist (the operator never deletes it: "
        "other models may share it). Unset: the claim must exist.",
    )
    hub_endpoint: Annotated[str, StringConstraints(max_length=512)] | None = Field(
        default=None,
        description="Hugging Face Hub mirror the download Job uses (HF_ENDPOINT), for clusters "
        "that must not reach huggingface.co. The model pods never reach either.",
    )


WEIGHTS_NEED_HF = Rule(
    f"!has(self.cache) || !has(self.cache.weights) || self.uri.matches('{CACHED_URI_RE}')",
    "model.cache.weights needs model.uri hf://org/name (optionally @revision): the cache "
    "downloads from the Hugging Face Hub, into a directory per organisation and name",
    holds=lambda m: m.cache.weights is None or _cached_uri(m.uri),
    field=".cache.weights",
    detail=lambda m: f"got {m.uri!r}",
)
WEIGHTS_NO_HUB_ADAPTERS = Rule(
    "!has(self.model.cache) || !has(self.model.cache.weights) || !has(self.adapters) || "
    "self.adapters.all(a, !a.uri.startsWith('hf://'))",
    "adapters[].uri: an hf:// adapter cannot be downloaded by the pods of a model with "
    "model.cache.weights (they start with the Hub off and without the token); put the adapter "
    "on a PVC (pvc://claim/path) or in the image",
    holds=lambda s: (
        s.model.cache.weights is None or not any(a.uri.startswith("hf://") for a in s.adapters)
    ),
    field=".adapters",
    detail=lambda s: ", ".join(a.name for a in s.adapters if a.uri.startswith("hf://")),
)
WEIGHTS_ONE_NODE = Rule(
    "!has(self.model.cache) || !has(self.model.cache.weights) || "
    "!has(self.parallelism.nodes) || self.parallelism.nodes == 1",
    "model.cache.weights is not supported with parallelism.nodes above 1 yet: use a pvc:// "
    "model filled beforehand, or the per-pod download (no model.cache.weights)",
    holds=lambda s: s.model.cache.weights is None or s.parallelism.nodes == 1,
    field=".model.cache.weights",
)


def _cached_uri(uri: str) -> bool:
    return re.match(CACHED_URI_RE, uri) is not None
