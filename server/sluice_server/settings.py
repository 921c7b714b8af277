"""One typed settings model for the server: CLI flags win over `SLUICE_*` environment.

The flag names are a contract with the operator (docs/design.md); keep them stable.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

Protocol = Literal["sse", "websocket"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="forbid")

    # What to serve
    model: str
    revision: str | None = None
    served_model_name: str | None = None
    engine: Literal["vllm", "simulator"] = "vllm"

    # Where
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)

    # vLLM engine (None = vLLM's own default)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    swap_space: float | None = Field(None, ge=0)
    dtype: str = "auto"
    quantization: str | None = None
    # Everything after `--` on the command line, handed to vLLM's argument parser unchanged.
    engine_args: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Streaming behaviour
    protocols: Annotated[list[Protocol], NoDecode] = Field(
        default_factory=lambda: ["sse", "websocket"]
    )
    heartbeat_seconds: float = Field(15.0, gt=0)
    max_concurrent_streams: int = Field(256, ge=1)
    stream_timeout_seconds: float = Field(600.0, gt=0)
    # A client that accepts no bytes for this long is cut off (stalled reader).
    send_timeout_seconds: float = Field(10.0, gt=0)
    # Per-stream buffer of undelivered tokens; over it the stream is aborted (stalled reader).
    stream_buffer_tokens: int = Field(4096, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    # Idle time before the server closes a kept-alive HTTP connection. It must be longer than
    # the proxy's upstream keep-alive (ingress-nginx: 60 s): otherwise the proxy can send a
    # request into a connection the server is just closing and answer that POST with 502.
    keep_alive_seconds: float = Field(75.0, gt=0)
    drain_timeout_seconds: float = Field(30.0, ge=0)

    # Security
    api_key_file: Path | None = None
    rate_limit_rpm: int = Field(0, ge=0)
    rate_limit_tpm: int = Field(0, ge=0)

    # Simulator engine timing
    sim_ttft_ms: float = Field(50.0, ge=0)
    sim_itl_ms: float = Field(20.0, ge=0)
    sim_ttft_per_stream_ms: float = Field(0.0, ge=0)
    sim_jitter: float = Field(0.0, ge=0)

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("protocols", mode="before")
    @classmethod
    def _split_protocols(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("engine_args", mode="before")
    @classmethod
    def _split_engine_args(cls, value: object) -> object:
        if isinstance(value, str):
            import shlex

            return shlex.split(value)
        return value

    @property
    def model_label(self) -> str:
        """The name clients send in `model` and metrics carry as a label."""
        return self.served_model_name or self.model


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """Flags mirror the Settings fields; unset flags stay absent so the environment applies."""
    parser = argparse.ArgumentParser(
        prog="sluice-server",
        description="Streaming LLM server. Arguments after `--` go to vLLM's engine parser.",
        argument_default=argparse.SUPPRESS,
    )
    for name, info in Settings.model_fields.items():
        if name == "engine_args":
            continue
        parser.add_argument(_flag(name), dest=name, help=info.description)
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1 :]
    given = vars(build_parser().parse_args(argv))
    if engine_args is not None:
        given["engine_args"] = engine_args
    # Init values win over env in pydantic-settings; pydantic converts the strings.
    return Settings(**given)
