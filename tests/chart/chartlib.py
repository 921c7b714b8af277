"""Helpers for the chart tests: find the real helm binary, render charts, load YAML.

helm comes from `.tools/bin/helm` (installed by `make tools`) or PATH; without it the helm
tests skip with one line. Other tests here (Dockerfile, adapter rules) need no helm.
The repository root, tool lookup and Kubernetes versions come from testing/testkit.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml
from testkit.k8s import K8S_VERSIONS
from testkit.repo import ROOT, find_tool

CHARTS = ROOT / "charts"
OPERATOR_CHART = CHARTS / "sluice-operator"
MODEL_CHART = CHARTS / "streaming-model"
HERE = Path(__file__).resolve().parent
CRD_FILE = ROOT / "crds" / "streamingmodels.serving.sluice.dev.yaml"


def find_helm() -> str | None:
    return find_tool("helm")


class Helm:
    def __init__(self, binary: str):
        self.binary = binary
        # Renders are pure functions of their arguments (and the files, which do not change
        # during a session): render each combination once, hand out copies.
        self._rendered: dict[tuple[str, ...], str] = {}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.binary, *args], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def template(
        self,
        chart: Path,
        *,
        values: list[Path] = (),
        set_: list[str] = (),
        namespace: str = "sluice-system",
        release: str = "sluice",
        include_crds: bool = False,
    ) -> list[dict]:
        args = ["template", release, str(chart), "--namespace", namespace]
        for v in values:
            args += ["-f", str(v)]
        for s in set_:
            args += ["--set", s]
        if include_crds:
            args.append("--include-crds")
        key = tuple(args)
        if key not in self._rendered:
            self._rendered[key] = self.run(*args).stdout
        return [d for d in yaml.safe_load_all(self._rendered[key]) if d]

    def template_error(self, chart: Path, *, set_: list[str]) -> str:
        args = ["template", "sluice", str(chart)]
        for s in set_:
            args += ["--set", s]
        proc = self.run(*args, check=False)
        assert proc.returncode != 0, f"expected helm template to fail with {set_}"
        return proc.stderr


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def activator_docs(docs: list[dict]) -> list[dict]:
    """The operator chart's activator objects (templates/activator.yaml), tested apart."""
    return [d for d in docs if _component(d) == "activator"]


def _component(doc: dict) -> str | None:
    return ((doc.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component")


def one(docs: list[dict], kind: str) -> dict:
    """The one object of `kind`, leaving out the activator's (`activator_docs`)."""
    found = [d for d in by_kind(docs, kind) if _component(d) != "activator"]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


POD_MONITOR_SCHEMA = ROOT / "tests" / "operator" / "schemas" / "podmonitor.schema.json"
HTTPROUTE_SCHEMA = ROOT / "tests" / "operator" / "schemas" / "gateway-httproute.schema.json"
INFERENCE_POOL_SCHEMA = ROOT / "tests" / "operator" / "schemas" / "inferencepool.schema.json"


def load_crd() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


def validate_k8s(doc: dict, versions: tuple[str, ...] = K8S_VERSIONS) -> None:
    """Validate one manifest against the official schemas (strict: unknown fields fail)."""
    import kubernetes_validate

    own = {  # not built-in kinds: strict schemas written from their projects' API references
        ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_SCHEMA,
        ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTPROUTE_SCHEMA,
        ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_SCHEMA,
    }.get((doc["apiVersion"], doc["kind"]))
    if own is not None:
        import jsonschema

        jsonschema.Draft202012Validator(json.loads(own.read_text())).validate(doc)
        return
    if doc["apiVersion"] == "monitoring.coreos.com/v1":
        # Prometheus Operator CRDs are not in the Kubernetes schemas; check the shape its
        # admission webhook checks first (tests/chart/test_prometheus_rules.py checks the rules).
        assert doc["kind"] == "PrometheusRule"
        groups = doc["spec"]["groups"]
        assert groups and all(g["name"] and g["rules"] for g in groups)
        return
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(
                f"{doc['kind']}/{doc['metadata'].get('name')} invalid for Kubernetes {version}: "
                f"{path}: {e.message}"
            ) from None


def validate_streaming_model(doc: dict) -> None:
    """Validate a StreamingModel against the generated CRD's openAPIV3Schema."""
    import jsonschema

    crd = load_crd()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert doc["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
    assert doc["kind"] == crd["spec"]["names"]["kind"]
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
    assert not errors, "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def documented_keys(values_file: Path) -> tuple[list[str], list[str]]:
    """(documented, undocumented) key paths of a values.yaml, as docs/helm.md's generator
    reads them (`sluice_operator.generate.chartdocs.parse_values`): a key is documented when
    the comment block right above it has a `# --` line; keys below a documented key are its
    content; a key without `# --` is a section whose children must all be documented."""
    from sluice_operator.generate.chartdocs import parse_values

    rows, undocumented = parse_values(values_file.read_text())
    return [r.key for r in rows], undocumented
