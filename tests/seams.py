"""Every implementation of each seam, handed to its Protocol, for the type checker.

`make lint` runs mypy over this module (pyproject.toml, `[tool.mypy]`): each function below
passes its implementations where the Protocol is expected, so an engine, a limiter, a
cluster client or a test fake that drifts from its Protocol (a method missing, a parameter
renamed, a return type changed) fails the lint. The Protocols are checked strictly, and so
are the modules that define them. Nothing here runs: tests/test_type_check.py runs mypy.
A new implementation (or a new test fake) gets a parameter here.
"""

from __future__ import annotations

from operator_helpers import AbsentKind, FakeCluster
from sluice_operator.cluster import Cluster, FencedCluster, KubeCluster
from sluice_server.core.limits.ratelimit import Limiter, MemoryLimiter, RedisLimiter
from sluice_server.engine.base import ApiServing, Engine
from sluice_server.engine.builtin_api import BuiltinApi
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.engine.vllm_api import VllmApi
from sluice_server.engine.vllm_engine import VllmEngine


def engines(simulator: SimulatorEngine, vllm: VllmEngine) -> list[Engine]:
    return [simulator, vllm]


def api_servings(builtin: BuiltinApi, vllm: VllmApi) -> list[ApiServing]:
    return [builtin, vllm]


def limiters(memory: MemoryLimiter, redis: RedisLimiter) -> list[Limiter]:
    return [memory, redis]


def clusters(
    kube: KubeCluster, fake: FakeCluster, absent: AbsentKind, fenced: FencedCluster
) -> list[Cluster]:
    return [kube, fake, absent, fenced]
