"""The Kubernetes versions the tests hold the product to, in one place.

Manifests (the operator's children, the charts' renders, the samples) are validated
strictly against the official schemas that `kubernetes-validate` ships offline, for each
of these versions:

- OLDEST, 1.33: the oldest minor the manifests are checked against. The charts declare
  `kubeVersion: >=1.30.0-0`; clusters older than 1.33 are admitted but not checked here.
- NEWEST, 1.36: the version of the e2e control plane (docs/e2e.md), so what the unit tests
  validate is what the live tests apply.

Tests that need one end only (a negative control, "valid on the newest") index
`K8S_VERSIONS[0]` / `K8S_VERSIONS[-1]`.
"""

from __future__ import annotations

OLDEST = "1.33"
NEWEST = "1.36"
K8S_VERSIONS = (OLDEST, NEWEST)
