"""kopf's own writes, made by the Lease holder only, and its requests named after the replica.

kopf writes for itself: its handler-progress and last-handled-configuration annotations,
its Events, and any request its session retries. Under `--leader-elect` a standby watches
like the leader but must send none of those: the storages below write only while
`leading()`, the session's middleware (`write_fence`) refuses every write that is not,
and the composition root (`wiring.py`) turns kopf's Event posting on and off with the Lease.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import kopf

from . import __version__

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def user_agent(identity: str | None) -> str:
    """What every request of this replica carries, so an audit log tells replicas apart."""
    return f"sluice-operator/{__version__}" + (f" ({identity})" if identity else "")


class LeaderOnlyProgress(kopf.AnnotationsProgressStorage):
    """kopf's handler progress annotations, written only while this replica leads."""

    def __init__(self, leading: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._leading = leading

    def store(self, **kwargs: Any) -> None:
        if self._leading():
            super().store(**kwargs)

    def purge(self, **kwargs: Any) -> None:
        if self._leading():
            super().purge(**kwargs)

    def touch(self, **kwargs: Any) -> None:
        if self._leading():
            super().touch(**kwargs)


class LeaderOnlyDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled-configuration annotation, written only while this replica leads
    (a standby's skipped handlers would otherwise record the change as handled)."""

    def __init__(self, leading: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._leading = leading

    def store(self, **kwargs: Any) -> None:
        if self._leading():
            super().store(**kwargs)


Middleware = Callable[[Any, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]


def write_fence(leading: Callable[[], bool]) -> Middleware:
    """An aiohttp client middleware for kopf's session: a write is refused (nothing sent)
    unless this replica leads. kopf composes its annotation patches and Events only while
    leading (the storages above, `posting.enabled`), but retries a request that failed
    (a connection cut, an apiserver 5xx) for up to a minute: without this, a patch composed
    before the Lease was lost could be sent again after a standby took over."""
    import aiohttp

    async def fence(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        if request.method not in READ_METHODS and not leading():
            raise aiohttp.ClientConnectionError(
                f"not the leader: {request.method} {request.url.path} not sent"
            )
        return await handler(request)

    return fence


def kopf_session(
    info: kopf.ConnectionInfo, identity: str | None, leading: Callable[[], bool]
) -> kopf.AiohttpSession:
    """kopf's login (`info`: the Kubernetes client's in-cluster config or kubeconfig) in an
    aiohttp session that sends our user agent (kopf's requests, watches, annotations and
    Events then name the replica in the audit log like the operator's own requests do) and
    refuses writes while this replica is not the leader (`write_fence`)."""
    import aiohttp

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
        headers={**info.as_http_headers(), "User-Agent": user_agent(identity)},
        proxy=info.proxy_url,
        trust_env=info.trust_env,
        middlewares=(write_fence(leading),),
    )
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        priority=info.priority,
        expiration=info.expiration,
    )
