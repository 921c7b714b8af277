"""The image a model's pods run: spec.image when the model chose one, else the operator's
default (`run --model-image`, the operator chart's modelImage), with the value older CRDs
stored in every object (FORMER_DEFAULT_IMAGE) counted as unset."""

from __future__ import annotations

import logging

import kopf
import pytest
import yaml
from operator_helpers import FakeCluster, body_of, minimal, runtime_for
from sluice_operator import cli, handlers
from sluice_operator.builders.secrets import redis_url_in_env
from sluice_operator.kinds import desired_children
from sluice_operator.models.resource import DEFAULT_MODEL_IMAGE, OperatorDefaults
from sluice_operator.models.spec import FORMER_DEFAULT_IMAGE
from sluice_operator.validation import load_model, parse_spec
from testkit.repo import ROOT

PRIVATE = OperatorDefaults(model_image="registry.example.com:5000/sluice/sluice-server:0.1.0")
MINE = "registry.example.com/team-a/sluice-server:pinned"
TWO_NODES = {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}
REDIS = {"requestsPerMinute": 60, "backend": "redis", "redisUrlSecretRef": {"name": "redis"}}


def images(body: dict, defaults: OperatorDefaults | None = None) -> list[str]:
    """The image of every container the operator renders for the model."""
    out = []
    for manifest in desired_children(load_model(body, defaults=defaults)).values():
        spec = (manifest or {}).get("spec") or {}
        group = spec.get("leaderWorkerTemplate")
        pods = [group["leaderTemplate"], group["workerTemplate"]] if group else []
        if "template" in spec:
            pods.append(spec["template"])
        out += [c["image"] for pod in pods for c in pod["spec"]["containers"]]
    return out


def test_the_crd_stores_no_default_for_spec_image():
    """An object that leaves spec.image out keeps it out: the operator can tell unset from a
    choice (a CRD default would store the built-in image in every object)."""
    assert parse_spec({"model": {"uri": "hf://org/model"}}).image is None
    crd = yaml.safe_load((ROOT / "crds/streamingmodels.serving.sluice.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    image = schema["properties"]["image"]
    assert "default" not in image and "image" not in schema.get("required", [])
    assert "--model-image" in image["description"] and FORMER_DEFAULT_IMAGE in image["description"]


@pytest.mark.parametrize("spec", [{}, TWO_NODES], ids=["one-node", "two-nodes"])
def test_unset_spec_image_runs_the_operators_default(spec):
    assert images(minimal(**spec)) and set(images(minimal(**spec))) == {DEFAULT_MODEL_IMAGE}
    assert set(images(minimal(**spec), PRIVATE)) == {PRIVATE.model_image}


@pytest.mark.parametrize("spec", [{}, TWO_NODES], ids=["one-node", "two-nodes"])
def test_a_stored_former_default_counts_as_unset(spec):
    """Objects created under the CRD that defaulted spec.image hold FORMER_DEFAULT_IMAGE:
    they follow the operator's default like models that never had it."""
    body = minimal(**spec, image=FORMER_DEFAULT_IMAGE)
    assert load_model(body).spec.image == FORMER_DEFAULT_IMAGE
    assert set(images(body, PRIVATE)) == {PRIVATE.model_image}
    assert images(body) == images(minimal(**spec))


@pytest.mark.parametrize("spec", [{}, TWO_NODES], ids=["one-node", "two-nodes"])
def test_a_models_own_image_wins_over_any_default(spec):
    for defaults in (None, PRIVATE):
        assert set(images(minimal(**spec, image=MINE), defaults)) == {MINE}
    # The same repository at another tag is a choice too, not the former default.
    other = FORMER_DEFAULT_IMAGE.replace(":0.1.0", ":0.1.1")
    assert set(images(minimal(**spec, image=other), PRIVATE)) == {other}


def test_the_redis_url_fallback_reads_the_image_the_pod_gets():
    """An operator default from before `--redis-url-file` gets the URL in env; a model that
    pins a newer image does not, and a stored former default follows the default."""
    old = OperatorDefaults(model_image="registry.example.com/sluice-server:0.0.9")
    auth = {"rateLimit": REDIS}
    assert redis_url_in_env(load_model(minimal(auth=auth), defaults=old))
    assert redis_url_in_env(
        load_model(minimal(auth=auth, image=FORMER_DEFAULT_IMAGE), defaults=old)
    )
    assert not redis_url_in_env(load_model(minimal(auth=auth)))
    assert not redis_url_in_env(load_model(minimal(auth=auth, image=MINE), defaults=old))


def test_the_running_operator_hands_its_default_to_every_pass(monkeypatch):
    """`Options.defaults` (from `run --model-image`) reaches the builders through the runtime
    and the passes: the applied Deployment runs the default, and a model's own image."""
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    cluster = FakeCluster()
    cluster.runtime = runtime_for(cluster, defaults=PRIVATE)
    for name, image in (("unset", None), ("former", FORMER_DEFAULT_IMAGE), ("mine", MINE)):
        spec = {} if image is None else {"image": image}
        body = body_of({**minimal(**spec), "metadata": {"name": name}})
        cluster.store(body)
        handlers.reconcile(body=body, namespace="default", name=name, memo=cluster.memo,
                           retry=0, logger=logging.getLogger("test"))  # fmt: skip
        deployment = cluster.objects[("Deployment", "default", name)]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] == (image if image == MINE else PRIVATE.model_image), name


def test_run_and_render_take_model_image(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(cli.MODEL_IMAGE_ENV, raising=False)
    parse = cli.build_parser().parse_args
    assert cli.operator_defaults(parse(["run"])) == OperatorDefaults()
    assert cli.operator_defaults(parse(["render", "-f", "x"])) == OperatorDefaults()
    assert cli.operator_defaults(parse(["run", "--model-image", MINE])).model_image == MINE
    monkeypatch.setenv(cli.MODEL_IMAGE_ENV, PRIVATE.model_image)
    assert cli.operator_defaults(cli.build_parser().parse_args(["run"])) == PRIVATE
    # render is offline: the flag, never the operator's environment.
    assert cli.operator_defaults(cli.build_parser().parse_args(["render", "-f", "x"])) == (
        OperatorDefaults()
    )
    with pytest.raises(ValueError, match="--model-image"):
        cli.operator_defaults(parse(["run", "--model-image", " "]))
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"kind": "StreamingModel", **minimal()}))
    assert cli.main(["render", "-f", str(path), "--model-image", MINE]) == 0
    rendered = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == MINE
    assert cli.main(["render", "-f", str(path), "--model-image", ""]) == 2
