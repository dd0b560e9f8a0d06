"""The one configuration object: a TOML file plus YIELDGATE_* environment overrides.

An override names a path with double underscores: YIELDGATE_SERVER__PORT=9000 sets
[server] port = 9000; YIELDGATE_SERVER__ADMIN_TOKEN sets the admin credential.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

import msgspec

from yieldgate.pricing import PricingConfig
from yieldgate.pricing.release_gate import CanaryGateConfig
from yieldgate.serving import FleetConfig, home_dir

ENV_PREFIX = "YIELDGATE_"


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str = ""              # required for /admin/*; "" = admin API disabled
    require_keys: bool = False         # inference endpoints need an API key
    allow_insecure_public: bool = False  # bind a non-loopback address with no credentials at all
    redis_url: str = "redis://127.0.0.1:6379/0"
    # PostgreSQL, the system of record for API keys, teams and budgets (and the ledger with
    # pricing.ledger.store = "postgres"); Redis then only caches them. "" = Redis holds the keys.
    # e.g. postgresql://yieldgate@db.internal:5432/yieldgate; YIELDGATE_SERVER__POSTGRES_URL.
    postgres_url: str = ""
    # How often the gateway checks that Redis still holds its epoch marker (a Redis restarted
    # empty is rebuilt: keys reloaded from PostgreSQL, budget counters re-seeded from the ledger).
    cache_check_s: float = 1.0
    data_dir: str = ""                 # ledger and journal; "" = <YIELDGATE_HOME>/data
    log_content: bool = False          # never log prompts or completions unless set
    cors_origins: list[str] = []       # CORS is off unless origins are listed
    # Idle keep-alive connections from clients are closed after this long. Longer than the pool
    # expiry of common clients (httpx and the openai client 5 s, aiohttp 15 s, load balancers
    # 60 s): with uvicorn's 5 s default a client reusing a connection the gateway closes at the
    # same moment gets "connection reset by peer", and a loop stalled by a loaded host fires the
    # timer with the next request already waiting in the socket.
    keep_alive_s: float = 75.0
    # Per-request features that can be switched off, so that each one's cost can be measured
    # (benchmarks/gateway_overhead.py). Off means: no billing record per request (reports and
    # feedback answer 503), or no Prometheus request/token/cost series.
    ledger: bool = True
    request_metrics: bool = True
    # Names this gateway in every ledger record, the x-yieldgate-gateway header and
    # yieldgate_gateway_info; "" = "<hostname>-<pid>". Several gateways may share one Redis.
    instance_id: str = ""
    # SIGTERM: /readyz answers 503 at once while the listener keeps accepting for drain_s (the
    # load balancer's time to notice), then in-flight requests get stop_timeout_s to finish; past
    # that, or on a second SIGTERM, streams are ended with an error event (billed for what was
    # relayed). Ctrl-C (SIGINT) skips the drain_s window.
    drain_s: float = 5.0
    stop_timeout_s: float = 30.0
    # Gateway processes serving this port (gateway/workers.py): each binds it with SO_REUSEPORT and
    # shares state through Redis/PostgreSQL as separate gateways do; one SIGTERM drains them all.
    # About one per core the gateway may use (docs/deployment.md).
    workers: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"server.workers must be >= 1, not {self.workers}")
        if self.keep_alive_s <= 0:
            raise ValueError(f"server.keep_alive_s must be > 0, not {self.keep_alive_s}")
        if self.drain_s < 0 or self.stop_timeout_s < 0:
            raise ValueError("server.drain_s and server.stop_timeout_s must be >= 0")
        # Keys, budgets and rate limits live in Redis: there is no Redis-less mode to fall back to.
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"server.redis_url must be a redis://, rediss:// or unix:// URL, not {self.redis_url!r}")
        if self.postgres_url and not self.postgres_url.startswith(("postgresql://", "postgres://")):
            raise ValueError("server.postgres_url must be a postgresql:// URL")
        if self.cache_check_s <= 0:
            raise ValueError("server.cache_check_s must be > 0")


class RequestLimits(msgspec.Struct, forbid_unknown_fields=True):
    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 2048
    max_tokens: int = 4096
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 300.0
    streams_per_key: int = 64
    # How long a request waits while every replica of its tier swaps weights at once (an
    # all_at_once rollout holds new requests) before it gets a 503.
    weight_swap_hold_s: float = 60.0


class LaneConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The flex and batch lanes (docs/batch.md): engine priorities and admission."""

    # Send vLLM's per-request `priority` (lower first) for flex and batch requests; the engines
    # must run with --scheduling-policy priority (`yieldgate up` launches them so).
    priority: bool = True
    flex_priority: int = 1
    batch_priority: int = 2
    # A flex request gets a 429 with retry-after when every replica of its tier has more than
    # this many requests waiting in its engine: refused at once rather than left to time out.
    flex_max_waiting: int = 8
    flex_retry_after_s: int = 10
    # Batch lines enter a replica only while its engine's waiting queue is at most batch_max_waiting,
    # and at most batch_lines_per_replica of this gateway's lines run on it at once.
    batch_max_waiting: int = 0
    batch_lines_per_replica: int = 4
    batch: bool = True                 # run the Batch API and its worker (needs server.postgres_url)
    batch_poll_s: float = 1.0          # how often an idle worker looks for work
    batch_lease_s: float = 30.0        # a claimed line returns to the queue if its lease is not renewed
    max_file_bytes: int = 200 * 1024 * 1024   # an upload; a Message Batches create body, too
    max_batch_requests: int = 100_000          # lines of one job (Anthropic's limit for a message batch)

    def __post_init__(self) -> None:
        if self.batch_lines_per_replica < 1 or self.batch_lease_s <= 0 or self.batch_poll_s <= 0:
            raise ValueError("lanes.batch_lines_per_replica, batch_lease_s and batch_poll_s must be > 0")
        if self.max_batch_requests < 1:
            raise ValueError("lanes.max_batch_requests must be >= 1")
        if min(self.flex_priority, self.batch_priority) < 1:
            raise ValueError("lanes.flex_priority and lanes.batch_priority must be >= 1 (0 is interactive)")


class PickerAdapter(msgspec.Struct, forbid_unknown_fields=True):
    """A LoRA adapter version the picker places on its engines at start (it has no admin API)."""

    name: str
    version: str
    path: str                          # a PEFT directory the engines can read
    tiers: list[str] | None = None     # default: every tier


class PickerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`yieldgate picker`: the endpoint picker an Envoy's ext_proc filter calls (docs/picker.md)."""

    host: str = "127.0.0.1"
    port: int = 9002                   # the Gateway API Inference Extension's usual EPP port
    adapters: list[PickerAdapter] = []


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True):
    """OpenTelemetry traces (gateway/tracing.py, docs/deployment.md): a span per request exported
    over OTLP. Off unless an endpoint is set; off, no span object is made."""

    endpoint: str = ""                 # OTLP collector, e.g. http://127.0.0.1:4317 (gRPC) or :4318/v1/traces
    protocol: str = "grpc"             # "grpc" or "http/protobuf"
    sample_ratio: float = 1.0          # of the traces the gateway starts; a client's sampled flag wins
    service_name: str = "yieldgate"
    # Engines that `yieldgate up` launches export their own spans to the same endpoint
    # (vLLM's --otlp-traces-endpoint), children of the gateway's span.
    engines: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"tracing.sample_ratio must be within [0, 1], not {self.sample_ratio}")
        if self.protocol not in ("grpc", "http/protobuf"):
            raise ValueError(f'tracing.protocol must be "grpc" or "http/protobuf", not {self.protocol!r}')


class AliasTarget(msgspec.Struct, forbid_unknown_fields=True):
    """One target of an alias: a model the gateway serves (":fast" for its fast tier), or one of
    its LoRA adapters, current or at a version ("name@version")."""

    model: str
    weight: float = 1.0


class AliasConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A name clients send for one target (`prod` -> a model, or an adapter at a version) or a
    weighted split between several (an A/B of a new checkpoint). A session (x-session-id, or the
    request's `user`) keeps its target, so a conversation is not split across models."""

    targets: list[AliasTarget]
    sticky: bool = True

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("an alias needs at least one target")
        if any(t.weight <= 0 for t in self.targets):
            raise ValueError("alias target weights must be > 0")


class AutoConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`model: "auto"` (docs/models.md#auto): the target with the lowest expected $ per solved task
    for the request's task class, from the graded outcomes the gateway records."""

    enabled: bool = False
    name: str = "auto"                 # the model name that asks for it
    # The candidates (model names, ":fast" tiers, adapters); [] = every model, its fast tier, its adapters.
    targets: list[str] = []
    explore: float = 0.1               # of requests for a target with too few graded tasks
    min_graded: int = 20               # graded tasks per target and class before it can win
    confidence: float = 0.95           # one-sided: a new target wins only when cheaper beyond noise
    refresh_s: float = 10.0            # how often the graded outcomes are read again from the ledger
    max_classes: int = 64              # task classes learned apart; more names count as unlabelled
    window_s: float = 7 * 86400.0      # ... over this much of the past

    def __post_init__(self) -> None:
        if not 0 <= self.explore < 1 or not 0.5 < self.confidence < 1 or self.min_graded < 1:
            raise ValueError("auto: explore within [0, 1), confidence within (0.5, 1), min_graded >= 1")
        if self.refresh_s <= 0 or self.window_s <= 0:
            raise ValueError("auto.refresh_s and auto.window_s must be > 0")


class Config(msgspec.Struct, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    limits: RequestLimits = msgspec.field(default_factory=RequestLimits)
    fleet: FleetConfig = msgspec.field(default_factory=FleetConfig)
    # More base models behind the same endpoint, each a fleet of its own (tiers, replicas or
    # discovery, LoRA, block size); [fleet] is the first (docs/models.md). Their replicas are listed.
    models: list[FleetConfig] = []
    aliases: dict[str, str | AliasConfig] = {}   # a name -> a target, or a split between targets
    auto: AutoConfig = msgspec.field(default_factory=AutoConfig)
    pricing: PricingConfig = msgspec.field(default_factory=PricingConfig)
    picker: PickerConfig = msgspec.field(default_factory=PickerConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    lanes: LaneConfig = msgspec.field(default_factory=LaneConfig)
    canary: CanaryGateConfig = msgspec.field(default_factory=CanaryGateConfig)  # adapter canaries judged on a timer

    def __post_init__(self) -> None:
        fleets = self.fleets
        names = [f.model for f in fleets]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        replicas = [r.name for f in fleets for r in f.replicas]
        repeated = sorted({r for r in replicas if replicas.count(r) > 1})
        if repeated:
            raise ValueError(f"replica names must be unique across models: {repeated} "
                             "(a model in [[models]] lists its replicas under names of their own)")
        for f in fleets:
            if f.fallback_model and (f.fallback_model == f.model or f.fallback_model not in names):
                raise ValueError(f"model {f.model!r}: fallback_model must be another model of this "
                                 f"gateway (one of {names}), not {f.fallback_model!r}")
        for alias, target in list(self.aliases.items()):
            if alias in names or alias.endswith(":fast") or (self.auto.enabled and alias == self.auto.name):
                raise ValueError(f"alias {alias!r} is already a model's name")
            if isinstance(target, str):  # `prod = "smollm2"`: one target
                self.aliases[alias] = AliasConfig(targets=[AliasTarget(model=target)])
        if self.auto.enabled and self.auto.name in names:
            raise ValueError(f"auto.name {self.auto.name!r} is already a model's name")

    @property
    def fleets(self) -> list[FleetConfig]:
        """Every base model's fleet, [fleet] first."""
        return [self.fleet, *self.models]


class ConfigError(ValueError):
    pass


def check_state(config: Config) -> None:
    """The ledger in PostgreSQL needs to know which PostgreSQL."""
    ledger = config.pricing.ledger
    if ledger.store == "postgres" and not (ledger.postgres_url or config.server.postgres_url):
        raise ConfigError('pricing.ledger.store = "postgres" needs server.postgres_url '
                          '(or pricing.ledger.postgres_url)')


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
    apply_env_overrides(raw, os.environ if env is None else env)
    try:
        # strict=False: environment values are strings ("9000" for an int field).
        config = msgspec.convert(raw, Config, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
    check_state(config)
    return config


def apply_env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = key[len(ENV_PREFIX):].lower().split("__")
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
