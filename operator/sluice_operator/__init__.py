"""Sluice operator: StreamingModel -> Deployment, Service, Ingress, HPA, PDB."""

from importlib import metadata

try:
    # For logs and the user agent only: nothing an operator renders may depend on it
    # (tests/operator/test_operator_golden.py), or every release would restart every model.
    __version__ = metadata.version("sluice-operator")
except metadata.PackageNotFoundError:  # a source tree without the package installed
    __version__ = "0.0.0+source"
