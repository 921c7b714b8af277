"""Sluice operator: StreamingModel -> Deployment, Service, Ingress, HPA, PDB."""
