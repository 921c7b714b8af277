"""The harness's control plane with what the HPA on a custom metric needs.

- API aggregation: kube-apiserver gets a front-proxy CA (`--requestheader-client-ca-file`)
  and a proxy client certificate, so it can forward `custom.metrics.k8s.io` calls to an
  extension API server that authenticates it, as in a kubeadm cluster.
- kube-controller-manager syncs HPAs every 5 s instead of 15 s (shorter test, same logic).
"""

from __future__ import annotations

from ..harness.control_plane import ControlPlane
from ..harness.pki import CertificateAuthority

FRONT_PROXY_USER = "front-proxy-client"
HPA_SYNC_PERIOD = "5s"


class AggregatingControlPlane(ControlPlane):
    def _make_pki(self) -> None:
        super()._make_pki()
        self.front_proxy_ca = CertificateAuthority(
            self.pki_dir / "front-proxy", name="front-proxy-ca"
        )
        self.proxy_client = self.front_proxy_ca.client("front-proxy-client", FRONT_PROXY_USER)

    def _spawn(self, name, argv):
        if name == "kube-apiserver":
            argv = [*argv,
                    "--requestheader-client-ca-file", str(self.front_proxy_ca.cert_path),
                    "--requestheader-allowed-names", FRONT_PROXY_USER,
                    "--requestheader-username-headers", "X-Remote-User",
                    "--requestheader-group-headers", "X-Remote-Group",
                    "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
                    "--proxy-client-cert-file", str(self.proxy_client.cert),
                    "--proxy-client-key-file", str(self.proxy_client.key)]  # fmt: skip
        elif name == "kube-controller-manager":
            argv = [*argv, f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}"]
        return super()._spawn(name, argv)

    def client_kubeconfig(self, name: str, user: str):
        """A kubeconfig for a client certificate of `user` (RBAC decides what it may do)."""
        from ..harness.kubeconfig import write_kubeconfig

        files = self.ca.client(name, user)
        return write_kubeconfig(self.workdir / f"{name}.kubeconfig", self.url, self.ca.cert_path,
                                user, cert=files.cert, key=files.key)  # fmt: skip
