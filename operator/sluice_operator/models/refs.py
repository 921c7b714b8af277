"""Names of objects in the StreamingModel's namespace, and references to them."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from .base import ApiModel

# Object names (Secrets, PVCs, ...): DNS-1123 subdomain.
Name = Annotated[
    str,
    StringConstraints(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
]


class SecretKeyRef(ApiModel):
    """A key in a Secret in the StreamingModel's namespace."""

    name: Name = Field(description="Name of the Secret (same namespace as the StreamingModel).")
    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="token", description="Key inside the Secret."
    )


class LocalObjectReference(ApiModel):
    """A reference to an object by name in the same namespace."""

    name: Name = Field(description="Object name.")
