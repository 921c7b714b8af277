"""`sluice-server` / `python -m sluice_server`: parse flags + env, serve, drain on SIGTERM
(one process, or a supervisor of `--api-workers` front-end processes); with `--node-rank`
above 0 a multi-node worker, vLLM's headless workers only; `sluice-server router ...` the
router (router/; `activator` is the same mode under its older name, which charts call)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from .serve import serve, serve_router
    from .settings import parse_router_settings, parse_settings
    from .supervisor import run_pod

    args = list(sys.argv[1:] if argv is None else argv)
    router = args[:1] in (["router"], ["activator"])
    try:
        if router:
            router_settings = parse_router_settings(args[1:])
        else:
            settings = parse_settings(args)
    except ValidationError as e:
        problems = "; ".join(
            # A check across fields (loc empty) names its flags in its message.
            f"--{'.'.join(str(x) for x in err['loc']).replace('_', '-')}: {err['msg']}"
            if err["loc"]
            else str(err["msg"]).removeprefix("Value error, ")
            for err in e.errors()
        )
        print(f"sluice-server: invalid settings: {problems}", file=sys.stderr)
        return 2
    if router:
        return serve_router(router_settings)
    if settings.headless:
        from .engine import run_engine_worker

        return run_engine_worker(settings)
    if settings.api_workers > 1:
        return run_pod(settings)
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
