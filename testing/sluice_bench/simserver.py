"""`python -m sluice_server` with the simulator's tokens stamped (fan-out benchmark only).

Same command line, same app, same uvicorn set-up as the real entry point; the one change
is that the simulator engine is built with `stamp_tokens=True`, so each token's text carries
the wall-clock time it was produced and the client can measure delivery lag. The patch is
applied on import, so `--api-workers` workers (spawned processes import this file again as
`__mp_main__`) stamp too.
"""

from __future__ import annotations

import functools

from sluice_server.engine import simulator


def _stamped(cls: type[simulator.SimulatorEngine]) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("stamp_tokens", True)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]  # the patch this module exists for


_stamped(simulator.SimulatorEngine)

if __name__ == "__main__":
    from sluice_server.__main__ import main

    main()
