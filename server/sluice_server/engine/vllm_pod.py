"""Several front-end processes on one vLLM engine core, launched by vLLM's own
multi-API-server machinery (what `vllm serve --api-server-count N` runs:
`vllm/entrypoints/cli/serve.py::run_multi_api_server`).

The supervisor binds the listening socket (`setup_server(reuse_port=True)`) and the ZMQ
listeners every front end talks to the engine over (`bind_engine_zmq_listeners`), starts
the engine core and waits for its handshake (`launch_core_engines`), then spawns the N
front ends with `APIServerProcessManager(target_server_fn=...)`: each runs our whole app,
and its engine is an AsyncLLM client of that core (`vllm_engine.open_vllm_engine` with the
worker's `client_config`, through vLLM's `build_async_engine_client`). Waiting is vLLM's
`wait_for_completion_or_failure`: it returns when every front end exited 0 and raises when
one died or the engine core did.

Only the signal handling, the pod's shared state and the exit code are ours
(`supervisor.py`); the launch and handshake are vLLM's, pinned with vLLM (0.32).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .vllm_engine import parse_vllm_args

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger(__name__)


@dataclass
class VllmWorkers:
    processes: list
    wait: Callable[[], None]
    shutdown: Callable[[float], None]


@contextlib.contextmanager
def vllm_workers(settings: Settings, model_path: str, target: Callable) -> Iterator[VllmWorkers]:
    """The engine core and `settings.api_workers` front ends running `target(listen_address,
    sock, args, client_config)`; everything shut down on exit."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager, wait_for_completion_or_failure

    n = settings.api_workers
    args = parse_vllm_args(settings, model_path)
    args.host, args.port, args.api_server_count = settings.host, settings.port, n
    listen_address, sock = setup_server(args, reuse_port=True)

    engine_args = AsyncEngineArgs.from_cli_args(args)
    propagate_flash_late_interaction(args, engine_args)
    engine_args._api_process_count = n
    engine_args._api_process_rank = -1
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    executor_class = Executor.get_class(vllm_config)
    log_stats = not engine_args.disable_log_stats

    manager = engine_manager = coordinator = listeners = None
    try:
        listeners = bind_engine_zmq_listeners(vllm_config, n)
        with launch_core_engines(
            vllm_config, executor_class, log_stats, listeners.addresses
        ) as launch:
            engine_manager, coordinator = launch.engine_manager, launch.coordinator
            stats = coordinator.get_stats_publish_address() if coordinator else None
            manager = APIServerProcessManager(
                listen_address=listen_address,
                sock=sock,
                args=args,
                num_servers=n,
                input_listeners=listeners.inputs,
                output_listeners=listeners.outputs,
                target_server_fn=target,
                stats_update_address=stats,
                tensor_queue=launch.tensor_queue,
            )
            # A front end that exits before the engine is up aborts the start-up.
            launch.watched_frontend_processes = manager.processes
        log.info("engine core up; %d front ends on %s", n, listen_address)
        yield VllmWorkers(
            manager.processes,
            lambda: wait_for_completion_or_failure(
                api_server_manager=manager,
                engine_manager=engine_manager,
                coordinator=coordinator,
            ),
            manager.shutdown,
        )
    finally:
        # Front ends first (they drain), then the engine core they were using.
        if manager is not None:
            manager.shutdown(timeout=5.0)
        deadline = time.monotonic() + max(5.0, float(vllm_config.shutdown_timeout))
        if engine_manager is not None:
            engine_manager.shutdown(timeout=max(0.0, deadline - time.monotonic()))
        if coordinator is not None:
            coordinator.shutdown(timeout=max(0.0, deadline - time.monotonic()))
        sock.close()
        del listeners  # now, not in a finalizer at interpreter exit (vLLM's __del__ fails there)
