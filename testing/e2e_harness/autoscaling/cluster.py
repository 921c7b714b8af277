"""The harness's control plane with what the HPA on a custom metric needs.

- API aggregation: kube-apiserver gets a front-proxy CA (`--requestheader-client-ca-file`)
  and a proxy client certificate, so it can forward `custom.metrics.k8s.io` calls to an
  extension API server that authenticates it, as in a kubeadm cluster.
- kube-controller-manager syncs HPAs every 5 s instead of 15 s (shorter test, same logic).
"""

from __future__ import annotations

from pathlib import Path

from ..control_plane import ControlPlane

FRONT_PROXY_USER = "front-proxy-client"
HPA_SYNC_PERIOD = "5s"


def aggregating_control_plane(workdir: Path, assets: Path, **options) -> ControlPlane:
    """A `ControlPlane` (not started) with the aggregation layer and a 5 s HPA sync;
    `options` are the ControlPlane's other fields (e.g. `audited_namespace`)."""
    return ControlPlane(
        workdir,
        assets,
        front_proxy_user=FRONT_PROXY_USER,
        extra_args={
            "kube-controller-manager": [
                f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}"
            ]
        },
        **options,
    )
