"""`sluice-server` / `python -m sluice_server` (drain on SIGTERM comes in drain.py)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .drain import serve
    from .settings import parse_settings

    return serve(parse_settings(argv))


if __name__ == "__main__":
    sys.exit(main())
