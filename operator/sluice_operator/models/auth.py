"""Client authentication and rate limits (`auth`): API keys, JWTs verified against a JWKS,
and per-key token buckets in memory or in Redis."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from .base import ApiModel, Rule, sub
from .refs import Name, SecretKeyRef


class ApiKeySecretRef(SecretKeyRef):
    """A Secret key holding API keys, one per line."""

    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="keys", description="Key inside the Secret; its value is one API key per line."
    )


class JwksKeyRef(ApiModel):
    """A key in a Secret or ConfigMap in the StreamingModel's namespace."""

    name: Name = Field(description="Name of the Secret or ConfigMap (same namespace).")
    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="jwks.json", description="Key inside it; its value is the JWKS (JSON)."
    )


class RedisUrlSecretRef(SecretKeyRef):
    """A Secret key holding the Redis URL (it may carry a password)."""

    key: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="url",
        description="Key inside the Secret; its value is a URL such as "
        "redis://:PASSWORD@redis.cache:6379/0 (rediss:// for TLS).",
    )


class RateLimitSpec(ApiModel):
    """Per API key (or JWT subject) token buckets (0 = unlimited)."""

    RULES = (
        Rule(
            "!has(self.backend) || self.backend != 'redis' || has(self.redisUrlSecretRef)",
            "rateLimit.backend redis needs rateLimit.redisUrlSecretRef",
            holds=lambda r: r.backend != "redis" or r.redis_url_secret_ref is not None,
            field=".redisUrlSecretRef",
        ),
    )

    requests_per_minute: int = Field(
        default=0,
        ge=0,
        description="Requests per minute per API key; 0 = unlimited. A key "
        "file line or a JWT claim may give a key its own.",
    )
    tokens_per_minute: int = Field(
        default=0,
        ge=0,
        description="Prompt + completion tokens per minute per API key, "
        "charged when a stream ends; 0 = unlimited.",
    )
    backend: Literal["memory", "redis"] = Field(
        default="memory",
        description="Where the buckets live: memory (each replica limits on its own, so N "
        "replicas allow N times the limit) or redis (one set of buckets for every replica; "
        "needs redisUrlSecretRef). No Redis is installed for you: use any the cluster has.",
    )
    redis_url_secret_ref: RedisUrlSecretRef | None = Field(
        default=None,
        description="Secret key with the Redis URL, mounted into the pod as the file the server "
        "reads (--redis-url-file), never in the environment or the arguments (except for a "
        "spec.image pinned to a server version from before that flag).",
    )
    failure_mode: Literal["open", "closed"] = Field(
        default="open",
        description="When Redis cannot be reached: open admits (counted and logged), closed "
        "refuses with 503 and Retry-After. The server retries Redis by itself.",
    )


class JwksSource(ApiModel):
    """Where the JWKS comes from: exactly one of a Secret key or a ConfigMap key."""

    RULES = (
        Rule(
            "has(self.secretRef) != has(self.configMapRef)",
            "auth.jwt.jwks needs exactly one of secretRef or configMapRef",
            holds=lambda j: (j.secret_ref is None) != (j.config_map_ref is None),
        ),
    )

    secret_ref: JwksKeyRef | None = Field(
        default=None, description="A Secret key whose value is the JWKS (JSON)."
    )
    config_map_ref: JwksKeyRef | None = Field(
        default=None, description="A ConfigMap key whose value is the JWKS (JSON)."
    )


class JwtSpec(ApiModel):
    """Bearer JWTs (RS256/ES256) verified against a JWKS; a short-lived token is what a
    browser page should carry instead of a long-lived API key."""

    issuer: Annotated[str, StringConstraints(min_length=1, max_length=2048)] = Field(
        description="The iss every token must carry."
    )
    audience: Annotated[str, StringConstraints(min_length=1, max_length=2048)] = Field(
        description="The aud every token must carry."
    )
    jwks: JwksSource = Field(
        description="The public keys tokens are verified against, mounted as a file and "
        "reloaded when it changes (rotate by adding the new key before retiring the old)."
    )
    tenant_claim: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="tenant",
        description="Claim naming the tenant (metrics and logs are labelled by tenant). The "
        "claims rpm and tpm give a token its limits.",
    )
    priority_claim: Annotated[str, StringConstraints(min_length=1, max_length=253)] = Field(
        default="priority",
        description="Claim naming the caller's priority class (with server.queue.priorities; "
        "a class that is not one of them: 401).",
    )


class AuthSpec(ApiModel):
    """Client authentication and rate limits."""

    api_key_secret_ref: ApiKeySecretRef | None = Field(
        default=None,
        description="Secret key with API keys, mounted as a file: one key per line, "
        "optionally followed by tenant=NAME rpm=N tpm=N models=A,B priority=CLASS weight=N "
        "(models: the served names, base or adapters, the key may use; priority and weight: "
        "server.queue). Reloaded when the Secret changes (no restart). Unset (and no jwt): no "
        "authentication.",
    )
    jwt: JwtSpec | None = Field(
        default=None, description="Accept Bearer JWTs (as well as API keys, if both are set)."
    )
    rate_limit: RateLimitSpec = sub(
        RateLimitSpec,
        "Per API key rate limits (need apiKeySecretRef or jwt to tell callers apart).",
    )
    share_prefix_cache_across_tenants: bool = Field(
        default=False,
        description="Let tenants reuse each other's cached prompt prefixes (faster first "
        "tokens for prompts they have in common). Off: the server salts vLLM's prefix cache "
        "with the caller's tenant, so no tenant can tell from its time to first token what "
        "another sent. Turn on only for tenants that trust each other. Without "
        "authentication every caller is one tenant and shares the cache.",
    )
