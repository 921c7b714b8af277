"""Files generated from the typed models (`python -m sluice_operator crds --write`).

`structural` turns pydantic's JSON Schema into a structural Kubernetes schema, `crd` wraps
it in the CRD; `apidocs` (docs/api.md) and `values_schema` (the streaming-model chart's
values.schema.json) each read the CRD dict; `outputs` names every file and writes or checks
them. Pure: no kopf, no API client, nothing read from a cluster.
"""
