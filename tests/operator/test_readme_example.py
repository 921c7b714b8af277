"""The StreamingModel shown in README.md is one the operator accepts and renders fully."""

import re

import yaml
from sluice_operator.render import render_objects
from testkit.repo import ROOT

README = ROOT / "README.md"


def test_readme_example_renders_every_child():
    block = re.search(r"```yaml\n(.*?)```", README.read_text(), re.S).group(1)
    body = yaml.safe_load(block)
    body["metadata"].setdefault("namespace", "default")
    kinds = {obj["kind"] for obj in render_objects(body)}
    assert kinds == {
        "Deployment",
        "Service",
        "Ingress",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
