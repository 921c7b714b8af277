"""The StreamingModel shown in README.md is one the operator accepts and renders fully."""

import re
from pathlib import Path

import yaml
from sluice_operator.render import render_objects

README = Path(__file__).resolve().parents[2] / "README.md"


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
