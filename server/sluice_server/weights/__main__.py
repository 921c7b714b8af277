"""`python -m sluice_server.weights fetch` or `remove`: the weights cache's download Job.

    fetch --repo ORG/NAME --revision REV --root /weights [--token-file PATH]
          [--progress-port N] [--result-file PATH]
    remove --root R --repo ORG/NAME (--keep COMMIT[,COMMIT...] | --all) [--result-file PATH]

The Hub is `HF_ENDPOINT` (a mirror) or the default Hub; the token comes from --token-file
only. The exit code is the outcome's (result.py); the result JSON goes to --result-file
(the termination message) and stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .result import EXIT_USAGE, Outcome, Result, write_result

log = logging.getLogger("sluice.weights")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sluice_server.weights")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download a revision into <root>/<org>/<name>/<commit>/")
    f.add_argument("--repo", required=True, help="the Hub repository, org/name")
    f.add_argument("--revision", required=True, help="a branch, tag or commit")
    f.add_argument("--root", required=True, type=Path, help="the cache volume's mount")
    f.add_argument("--token-file", type=Path, help="a file holding the Hub token (a Secret's key)")
    f.add_argument("--progress-port", type=int, help="serve GET /progress on this port")
    f.add_argument("--result-file", type=Path, default=Path("/dev/termination-log"))
    f.add_argument(
        "--attempts", type=int, default=5, help="tries of a call to the Hub that fails in passing"
    )
    f.add_argument(
        "--retry-wait",
        type=float,
        default=2.0,
        help="seconds before the second try, doubled each time",
    )
    r = sub.add_parser("remove", help="remove a repository's commit folders other than --keep")
    r.add_argument("--root", required=True, type=Path)
    r.add_argument("--repo", required=True)
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument("--keep", help="commits to keep, comma-separated")
    which.add_argument(
        "--all",
        action="store_true",
        help="remove every commit folder of the repository (no model uses it any more)",
    )
    r.add_argument("--result-file", type=Path, default=Path("/dev/termination-log"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if args.command == "remove":
        return _remove(args)
    return _fetch(args)


def _fetch(args: argparse.Namespace) -> int:
    from .fetch import Request, fetch
    from .hub import Hub
    from .layout import check_repo
    from .progress import Progress, serve_progress

    def done(outcome: Outcome, message: str) -> int:
        result = Result(outcome.label, args.repo, args.revision, None, 0, 0, message)
        write_result(args.result_file, result.to_json())
        return outcome.exit_code

    try:
        check_repo(args.repo)
    except ValueError as e:
        return done(Outcome.ERROR, f"{e}: check the model's hf:// URI")
    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip() or None
        except OSError as e:
            return done(
                Outcome.ERROR,
                f"the token file {args.token_file} cannot be read ({e.strerror}): check the Secret the cache names and its key",
            )
        if token is None:
            log.warning("the token file %s is empty: downloading without a token", args.token_file)
    progress = Progress()
    if args.progress_port is not None:
        try:
            serve_progress(progress, args.progress_port)
        except OSError as e:  # the download matters more than its progress
            log.warning(
                "cannot serve progress on port %d (%s): going on without", args.progress_port, e
            )
    hub = Hub(token, attempts=args.attempts, retry_wait=args.retry_wait)
    log.info("fetching %s@%s from %s into %s (%s)", args.repo, args.revision, hub.endpoint,
             args.root, "with a token" if token else "without a token")  # fmt: skip
    result = fetch(Request(args.repo, args.revision, args.root), hub, progress)
    write_result(args.result_file, result.to_json())
    return {o.label: o.exit_code for o in Outcome}[result.outcome]


def _remove(args: argparse.Namespace) -> int:
    from .layout import remove_other_commits

    keep = [c for c in (args.keep or "").split(",") if c]
    try:
        if not keep and not args.all:
            raise ValueError("--keep names no commit (to remove every revision, say --all)")
        removed, freed, skipped = remove_other_commits(args.root, args.repo, keep)
    except ValueError as e:
        log.error("%s", e)
        write_result(
            args.result_file,
            json.dumps({"outcome": "refused", "repo": args.repo, "message": str(e)}),
        )
        return EXIT_USAGE
    for commit in removed:
        log.info("removed %s@%s", args.repo, commit)
    for commit in skipped:
        log.warning("kept %s@%s: a download is writing it now", args.repo, commit)
    log.info(
        "removed %d commit folders of %s (%d bytes), kept %s",
        len(removed),
        args.repo,
        freed,
        ",".join(keep),
    )
    doc = {
        "outcome": "removed",
        "repo": args.repo,
        "removed": removed,
        "kept": keep,
        "skipped": skipped,
        "bytes": freed,
    }
    write_result(args.result_file, json.dumps(doc, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
