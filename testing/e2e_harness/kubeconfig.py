"""Kubeconfig files, one per identity, pointing at the loopback apiserver."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    user: str,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
) -> Path:
    """A kubeconfig with one cluster, one user (client certificate or bearer token), one context."""
    credentials: dict[str, str] = {}
    if cert and key:
        credentials = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        credentials = {"token": token}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": "e2e", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
