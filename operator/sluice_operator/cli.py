"""Command line: `crds` (generated files), `render` (print manifests), `run` (the operator).

Nothing here talks to a cluster except `run`, and that only after argument parsing, so the
first two work on a laptop without a kubeconfig (GitOps users render and commit the output).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .election import ElectionSettings
    from .models.resource import OperatorDefaults
    from .scaletozero_poller import ActivatorSettings

# The image of models without spec.image (`run --model-image`); the operator chart sets it
# from modelImage through its ConfigMap.
MODEL_IMAGE_ENV = "SLUICE_OPERATOR_MODEL_IMAGE"
# The router's master continuation key (`run --continuation-key-file`); the operator chart
# mounts the router's Secret and sets this.
CONTINUATION_KEY_FILE_ENV = "SLUICE_OPERATOR_CONTINUATION_KEY_FILE"
# The same bound as spec.image's.
MAX_IMAGE_LENGTH = 512


def _repo_root() -> Path:
    # operator/sluice_operator/cli.py -> repository root (the CRD lives in crds/ there).
    return Path(__file__).resolve().parents[2]


def _cmd_crds(args: argparse.Namespace) -> int:
    from .generate.crd import render_crd
    from .generate.outputs import stale_files, write_files

    root = Path(args.root) if args.root else _repo_root()
    if args.write:
        for path in write_files(root):
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = stale_files(root)
        for path in stale:
            print(f"stale: {path} (run `make crds`)", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(render_crd())
    return 0


def operator_defaults(args: argparse.Namespace) -> OperatorDefaults:
    """`--model-image` as `models.resource.OperatorDefaults` (ValueError when unusable)."""
    from .models.resource import OperatorDefaults

    image = args.model_image.strip()
    if not image or len(image) > MAX_IMAGE_LENGTH or any(c.isspace() for c in image):
        raise ValueError(
            f"--model-image must be an image reference of 1 to {MAX_IMAGE_LENGTH} characters "
            f"without spaces (got {args.model_image!r})"
        )
    return OperatorDefaults(model_image=image)


def _cmd_render(args: argparse.Namespace) -> int:
    from .render import render_file
    from .validation import SpecError

    try:
        defaults = operator_defaults(args)
    except ValueError as exc:
        print(f"sluice-operator render: {exc}", file=sys.stderr)
        return 2
    if args.continuation_key_file:
        from .continuationkey import ContinuationKeyFile

        key_file = ContinuationKeyFile(Path(args.continuation_key_file))
        defaults = key_file.defaults(defaults)
        if defaults.continuation_key is None:
            print(
                f"sluice-operator render: --continuation-key-file {args.continuation_key_file} "
                "holds no key",
                file=sys.stderr,
            )
            return 2
    try:
        text = render_file(Path(args.file), namespace=args.namespace, defaults=defaults)
    except SpecError as exc:
        print(f"{args.file}: invalid StreamingModel: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def election_settings(args: argparse.Namespace) -> ElectionSettings | None:
    """The `--leader-elect*` flags as `election.ElectionSettings` (None without the flag).
    The Lease holder is the identity plus a random suffix (client-go's hostname_uuid): a
    restarted container in the same pod is a new candidate, never the old leader."""
    if not args.leader_elect:
        return None
    from .election import ElectionSettings

    return ElectionSettings(
        name=args.leader_elect_resource_name,
        namespace=args.leader_elect_resource_namespace,
        identity=f"{args.identity}_{uuid.uuid4().hex[:8]}",
        lease_duration=args.leader_elect_lease_duration,
        renew_deadline=args.leader_elect_renew_deadline,
        retry_period=args.leader_elect_retry_period,
    )


def activator_settings(args: argparse.Namespace) -> ActivatorSettings | None:
    """The `--activator-*` flags as `scaler.ActivatorSettings` (None without the Service)."""
    if not args.activator_service:
        return None
    from .scaletozero_poller import ActivatorSettings

    return ActivatorSettings(
        service=args.activator_service,
        namespace=args.activator_namespace,
        selector=args.activator_selector,
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from .runner import run
    from .wiring import Options

    try:
        election = election_settings(args)
        defaults = operator_defaults(args)
    except ValueError as exc:
        print(f"sluice-operator run: {exc}", file=sys.stderr)
        return 2
    options = Options(
        resync_seconds=args.resync_seconds,
        max_rollouts=args.max_concurrent_model_rollouts,
        identity=args.identity,
        election=election,
        activator=activator_settings(args),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        defaults=defaults,
        continuation_key_file=(
            Path(args.continuation_key_file) if args.continuation_key_file else None
        ),
    )
    return run(
        namespaces=args.namespace,
        all_namespaces=args.all_namespaces,
        liveness=args.liveness,
        options=options,
        verbose=args.verbose,
        standalone=args.standalone or not args.peering,
        peering=args.peering,
        log_format=args.log_format,
    )


def build_parser() -> argparse.ArgumentParser:
    from .models.resource import DEFAULT_MODEL_IMAGE
    from .models.spec import FORMER_DEFAULT_IMAGE

    parser = argparse.ArgumentParser(prog="sluice-operator", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    crds = commands.add_parser(
        "crds",
        help="print the generated CRD, or write or check every generated file",
    )
    mode = crds.add_mutually_exclusive_group()
    mode.add_argument(
        "--write",
        action="store_true",
        help="write crds/, charts/sluice-operator/crds/, docs/api.md, "
        "charts/streaming-model/values.schema.json, the Grafana dashboard and docs/helm.md's "
        "values and RBAC tables",
    )
    mode.add_argument(
        "--check", action="store_true", help="exit 1 when a checked-in generated file is stale"
    )
    crds.add_argument(
        "--root", help="repository root (default: the checkout this package lives in)"
    )
    crds.set_defaults(func=_cmd_crds)

    render = commands.add_parser(
        "render", help="print the manifests the operator would apply for a StreamingModel"
    )
    render.add_argument(
        "-f",
        "--file",
        required=True,
        help="StreamingModel YAML (one or more documents; - for stdin)",
    )
    render.add_argument(
        "-n",
        "--namespace",
        default=None,
        help="namespace when the file does not set one (default: default)",
    )
    render.add_argument(
        "--model-image",
        default=DEFAULT_MODEL_IMAGE,
        metavar="IMAGE",
        help="the image of models without spec.image, as `run --model-image` (default: "
        "%(default)s)",
    )
    render.add_argument(
        "--continuation-key-file",
        default="",
        metavar="PATH",
        help="the router's master continuation key, as `run --continuation-key-file`: router "
        "models then render with their <name>-continuation-key Secret (the key derived from "
        "it) and its mount; unset: as an operator without the key (no stream migrates)",
    )
    render.set_defaults(func=_cmd_render)

    run = commands.add_parser(
        "run", help="run the operator against the current kubeconfig or in-cluster config"
    )
    scope = run.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch all namespaces (default)"
    )
    run.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL"
    )
    peer = run.add_mutually_exclusive_group()
    peer.add_argument(
        "--standalone", action="store_true", help="no peering (the default without --peering)"
    )
    peer.add_argument(
        "--peering",
        default=None,
        help="kopf peering object name: pause while a higher-priority operator runs (not "
        "leader election: see --leader-elect)",
    )
    run.add_argument(
        "--log-format", choices=["json", "plain", "full"], default="json", help="log format"
    )
    run.add_argument(
        "--resync-seconds",
        type=float,
        default=300.0,
        help="converge every model this often, from memory (a settled model costs no API "
        "call); 0 turns it off",
    )
    run.add_argument(
        "--max-concurrent-model-rollouts",
        type=int,
        default=2,
        metavar="N",
        help="when this operator release renders a new pod template for models nobody changed, "
        "roll at most N of them at a time, each until its new pods are Ready (0: no limit); "
        "a model whose own spec changed is never held back",
    )
    run.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="who this replica is, in its user agent and Lease holder identity (default: "
        "$POD_NAME, else the host name)",
    )
    elect = run.add_argument_group("leader election (several replicas, one writes)")
    elect.add_argument(
        "--leader-elect",
        action="store_true",
        help="only the holder of a coordination.k8s.io Lease reconciles; the others watch "
        "and take over when it stops renewing",
    )
    elect.add_argument(
        "--leader-elect-resource-name", default="sluice-operator", help="name of the Lease"
    )
    elect.add_argument(
        "--leader-elect-resource-namespace",
        default=os.environ.get("POD_NAMESPACE") or "default",
        help="namespace of the Lease (default: $POD_NAMESPACE, else default)",
    )
    elect.add_argument(
        "--leader-elect-lease-duration",
        type=float,
        default=15.0,
        help="seconds a standby waits after the Lease last changed before taking it",
    )
    elect.add_argument(
        "--leader-elect-renew-deadline",
        type=float,
        default=10.0,
        help="seconds the leader keeps writing without a successful renewal; then it stops",
    )
    elect.add_argument(
        "--leader-elect-retry-period",
        type=float,
        default=2.0,
        help="seconds between attempts to acquire or renew the Lease",
    )
    zero = run.add_argument_group("scale to zero (models with autoscaling.minReplicas 0)")
    zero.add_argument(
        "--activator-service",
        default="",
        metavar="NAME",
        help="the activator's Service in --activator-namespace: the per-model ExternalName "
        "Services point at it, and the operator keeps the ConfigMap NAME-models there; unset: "
        "no model is scaled to zero (nothing would wake it)",
    )
    zero.add_argument(
        "--activator-namespace",
        default=os.environ.get("POD_NAMESPACE") or "default",
        help="namespace of the activator (default: $POD_NAMESPACE, else default)",
    )
    zero.add_argument(
        "--activator-selector",
        default="app.kubernetes.io/component=activator",
        metavar="SELECTOR",
        help="label selector of the activator's pods, whose /metrics give the held requests",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the operator's own Prometheus metrics (scale-to-zero transitions, "
        "activation time) on this port at /metrics; 0: off",
    )
    run.add_argument("--metrics-host", default="0.0.0.0", help="address for --metrics-port")
    run.add_argument(
        "--model-image",
        default=os.environ.get(MODEL_IMAGE_ENV) or DEFAULT_MODEL_IMAGE,
        metavar="IMAGE",
        help=f"the image of every model that does not set spec.image (or still holds "
        f"{FORMER_DEFAULT_IMAGE}, the default older CRDs stored); changing it rolls those "
        f"models, paced by --max-concurrent-model-rollouts (default: ${MODEL_IMAGE_ENV}, "
        f"else {DEFAULT_MODEL_IMAGE})",
    )
    run.add_argument(
        "--continuation-key-file",
        default=os.environ.get(CONTINUATION_KEY_FILE_ENV) or "",
        metavar="PATH",
        help="the router's master continuation key (its first line; docs/migration.md): the "
        "operator writes each router model's key, derived from it, to the Secret "
        "<name>-continuation-key that the model's pods mount, so the router can continue a "
        "stream whose pod went away. Read at every pass (a rotated key applies without a "
        f"restart). Unset: no stream migrates (default: ${CONTINUATION_KEY_FILE_ENV})",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
