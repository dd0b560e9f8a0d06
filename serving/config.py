"""Fleet description: tiers -> replicas. A replica is a URL or a launch spec yieldgate starts."""

from __future__ import annotations

import msgspec

from yieldgate.cache.policies import PipelineSpec, RouterConfig, build_parts, preset

from .demo_model import DemoModelSpec
from .paths import home_dir  # noqa: F401  (re-exported)

TIERS = ("standard", "fast")


def kv_events_ipc(replica: str) -> str:
    """Where a launched engine publishes KV events. vLLM binds wildcard and ipc:// endpoints and
    *connects* to tcp://host:port ones; an IPC socket binds without listening on any network."""
    return f"ipc://{home_dir() / 'run' / f'kv-events-{replica}.sock'}"


class LaunchSpec(msgspec.Struct, forbid_unknown_fields=True):
    """A vLLM OpenAI server that yieldgate starts as a child process."""

    port: int
    args: list[str] = []          # extra `vllm serve` arguments
    env: dict[str, str] = {}
    cpus: str = ""                # OMP thread binding for vLLM's CPU backend, e.g. "0" or "0-1"
    kv_events: bool = False       # publish KV events on a local IPC socket (see kv_events_ipc)
    startup_timeout_s: float = 600.0


class SupervisionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How `yieldgate up` keeps the engines it launched running (serving/supervisor.py)."""

    enabled: bool = True
    # An engine that exits, or answers no health check for unhealthy_after_s, is restarted after
    # a backoff doubling from backoff_initial_s up to backoff_max_s ...
    unhealthy_after_s: float = 60.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    # ... at most max_restarts times in any window_s; then it stays down and says why.
    max_restarts: int = 5
    window_s: float = 600.0


class ReplicaConfig(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    tier: str = "standard"
    url: str = ""                 # an already running server; derived from launch.port otherwise
    launch: LaunchSpec | None = None
    cost_per_hour: str = "0"      # USD, a decimal string
    kv_events_endpoint: str = ""  # tcp://host:port of an external engine's KV event publisher

    @property
    def base_url(self) -> str:
        if self.url:
            return self.url.rstrip("/")
        if self.launch is None:
            raise ValueError(f"replica {self.name!r} needs either url or launch")
        return f"http://127.0.0.1:{self.launch.port}"

    @property
    def kv_events(self) -> str:
        if self.kv_events_endpoint:
            return self.kv_events_endpoint
        if self.launch is not None and self.launch.kv_events:
            return kv_events_ipc(self.name)
        return ""


class TierConfig(msgspec.Struct, forbid_unknown_fields=True):
    policy: str = "cache_aware"   # a preset: round_robin | least_loaded | session | cache_aware
    # Or a pipeline of registered parts (cache/policies.py), labelled `policy` in metrics.
    pipeline: PipelineSpec | None = None
    # cache_aware cost = overlap_weight * blocks_to_prefill + queued_request_blocks * load; replicas
    # with load > spill_factor * mean + spill_slack are skipped (see cache/routing.py).
    overlap_weight: float = 1.0
    queued_request_blocks: float = 4.0
    spill_factor: float = 1.5
    spill_slack: float = 2.0
    # ...and replicas past max(share_factor * mean, mean + share_slack) of recent picks, unless
    # they save >= share_keep_blocks blocks of prefill (long cached contexts stay home).
    share_factor: float = 1.15
    share_slack: float = 4.0
    share_keep_blocks: int = 16
    # Prefill routed to a replica whose first token is not back yet counts this much per block.
    pending_weight: float = 0.5
    # Blocks added to a replica's cost per unit of its recent-pick share above the mean.
    share_weight: float = 4.0
    # The tier that serves this tier's requests while none of its own replicas is routable (same
    # model); priced and labelled by the tier that served. "" = answer 503 instead.
    fallback: str = ""

    def __post_init__(self) -> None:
        # An unknown policy or part name is a config error at start-up, not at the first request.
        build_parts(self.pipeline or preset(self.policy), RouterConfig())


class FleetConfig(msgspec.Struct, forbid_unknown_fields=True):
    model: str = "demo"           # the name clients send; engines serve it as --served-model-name
    model_path: str = ""          # HF directory launched replicas load; "" = the generated demo model
    demo_model: DemoModelSpec = DemoModelSpec()  # that generated model's shape (seed, sizes)
    block_size: int = 32          # KV block size in tokens (a multiple of 32 on CPU)
    tiers: dict[str, TierConfig] = {}
    replicas: list[ReplicaConfig] = []
    # With no replicas listed, the fleet is the demo fleet: two launched engines on these ports.
    demo_base_port: int = 8101
    demo_engine_args: list[str] = []
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    # A probe that times out ejects a healthy replica only after this many in a row: a busy engine on a
    # loaded host stalls for seconds (9 s seen at load 10), a dead one refuses the connection at once.
    health_timeouts_to_eject: int = 3
    scrape_interval_s: float = 2.0
    log_dir: str = ""             # engine logs; "" = <YIELDGATE_HOME>/logs
    supervision: SupervisionConfig = SupervisionConfig()

    def __post_init__(self) -> None:
        if not self.replicas:
            self.replicas = demo_replicas(self.demo_base_port, self.demo_engine_args)
        if not self.tiers:
            present = sorted({r.tier for r in self.replicas})
            # Same model on both tiers: each serves the other's requests while it has no replica.
            self.tiers = {t: TierConfig(fallback=next((o for o in present if o != t), "")) for t in present}
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError("replica names must be unique")
        for r in self.replicas:
            if r.tier not in TIERS:
                raise ValueError(f"replica {r.name!r}: unknown tier {r.tier!r} (one of {TIERS})")
        for name, tier in self.tiers.items():
            if tier.fallback and (tier.fallback == name or tier.fallback not in TIERS):
                raise ValueError(f"tier {name!r}: fallback must be another tier (one of {TIERS}), "
                                 f"not {tier.fallback!r}")
        if self.health_timeouts_to_eject < 1:
            raise ValueError("health_timeouts_to_eject must be at least 1")
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError("block_size must be a positive multiple of 16")

    def tier(self, name: str) -> TierConfig:
        return self.tiers.get(name) or TierConfig()


# Shared by the demo engines. Prefix caching with cached-token counts in usage; KV events feed the
# precise prefix index; dev mode exposes /pause, /reset_prefix_cache and the weight-transfer API.
_COMMON_ARGS = [
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--gpu-memory-utilization", "0.3",
    "--max-model-len", "4096",
    "--max-num-seqs", "64",
    # The trainer bridge's weight-transfer backend (trainer_bridge.plugin): hot weight pushes.
    "--weight-transfer-config", '{"backend":"yieldgate"}',
]
# 8 drafts, not vLLM's usual 4: on CPU a speculative step costs ~2x a plain one even when nothing
# is accepted, so only long accepted runs pay (benchmarks/fast_vs_standard.py: greedy code edits
# 1.69x with 4, 2.05x with 8).
_SPEC_DECODE = (
    '{"method":"ngram","num_speculative_tokens":8,"prompt_lookup_max":4,"prompt_lookup_min":2}'
)


def demo_replicas(base_port: int, extra_args: list[str]) -> list[ReplicaConfig]:
    """One standard and one fast engine, each pinned to its own core of a 2-core machine."""
    extra = list(extra_args)
    return [
        ReplicaConfig(
            name="standard-0",
            tier="standard",
            cost_per_hour="0.40",
            launch=LaunchSpec(
                port=base_port, cpus="0", kv_events=True, args=_COMMON_ARGS + extra
            ),
        ),
        ReplicaConfig(
            name="fast-0",
            tier="fast",
            cost_per_hour="0.60",
            launch=LaunchSpec(
                port=base_port + 1,
                cpus="1",
                kv_events=True,
                args=_COMMON_ARGS + ["--speculative-config", _SPEC_DECODE] + extra,
            ),
        ),
    ]
