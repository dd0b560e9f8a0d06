"""Fleet description: tiers -> replicas. A replica is a URL or a launch spec yieldgate starts."""

from __future__ import annotations

import msgspec

from yieldgate.cache.policies import PipelineSpec, RouterConfig, build_parts, preset

from .demo_model import DemoModelSpec
from .models import served_name
from .paths import home_dir  # noqa: F401  (re-exported)

TIERS = ("standard", "fast")


def kv_events_ipc(replica: str) -> str:
    """Where a launched engine publishes KV events. vLLM binds wildcard and ipc:// endpoints and
    *connects* to tcp://host:port ones; an IPC socket binds without listening on any network."""
    return f"ipc://{home_dir() / 'run' / f'kv-events-{replica}.sock'}"


class LaunchSpec(msgspec.Struct, forbid_unknown_fields=True):
    """A vLLM OpenAI server that yieldgate starts as a child process."""

    port: int
    host: str = "127.0.0.1"       # the address the engine listens on (a loopback one of its own in tests)
    args: list[str] = []          # extra `vllm serve` arguments
    env: dict[str, str] = {}
    cpus: str = ""                # OMP thread binding for vLLM's CPU backend, e.g. "0" or "0-1"
    kv_events: bool = False       # publish KV events on a local IPC socket (see kv_events_ipc)
    startup_timeout_s: float = 600.0
    # The engine's processes poll the ring buffer they share by yielding for poll_spin_us, then
    # sleeping poll_pause_us a poll, instead of yielding for a whole second, which keeps a host's
    # other processes (the gateway) off the CPU for seconds while it decodes
    # (serving/engine_polling.py); poll_pause_us = 0: vLLM's own loop.
    poll_pause_us: float = 50.0
    poll_spin_us: float = 300.0


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


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """LoRA on the engines yieldgate launches, so adapters load at run time (gateway/adapters.py).
    Sized for the demo model: each slot is a rank-`max_rank` copy of every adapted projection."""

    enabled: bool = True
    max_loras: int = 2            # adapters in one batch, and adapters an engine holds at once
    max_rank: int = 8             # the largest rank an adapter may have (vLLM: 1, 8, 16, 32, 64, ...)
    # A request for an adapter that no replica of its tier holds waits this long for it to load
    # (a 503 `adapter_unavailable` after that).
    load_wait_s: float = 30.0
    # How often a gateway reads the adapter registry and residency other gateways wrote to Redis.
    sync_s: float = 0.5
    # Adapters with Prometheus series of their own; requests for the rest count as adapter="other".
    metric_series: int = 32

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("lora.max_loras must be at least 1")
        if self.load_wait_s <= 0 or self.sync_s <= 0:
            raise ValueError("lora.load_wait_s and lora.sync_s must be > 0")
        if self.max_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            raise ValueError(f"lora.max_rank must be one vLLM accepts (1, 8, 16, 32, ...), not {self.max_rank}")

    def engine_args(self) -> list[str]:
        if not self.enabled:
            return []
        return ["--enable-lora", "--max-lora-rank", str(self.max_rank), "--max-loras", str(self.max_loras)]


class ReplicaConfig(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    tier: str = "standard"
    url: str = ""                 # an already running server; derived from launch.port otherwise
    launch: LaunchSpec | None = None
    cost_per_hour: str = "0"      # USD, a decimal string
    kv_events_endpoint: str = ""  # tcp://host:port of an external engine's KV event publisher
    # Whether its engine runs speculative decoding (the `speculation` routing filter reads it);
    # None = whether its launch args have --speculative-config (an external engine: no).
    speculative: bool | None = None

    @property
    def speculates(self) -> bool:
        if self.speculative is not None:
            return self.speculative
        return self.launch is not None and "--speculative-config" in self.launch.args

    @property
    def base_url(self) -> str:
        if self.url:
            return self.url.rstrip("/")
        if self.launch is None:
            raise ValueError(f"replica {self.name!r} needs either url or launch")
        return f"http://{self.launch.host}:{self.launch.port}"

    @property
    def kv_events(self) -> str:
        if self.kv_events_endpoint:
            return self.kv_events_endpoint
        if self.launch is not None and self.launch.kv_events:
            return kv_events_ipc(self.name)
        return ""


DISCOVERY_KINDS = ("static", "dns", "kubernetes")
KUBERNETES_RESOURCES = ("endpointslices", "pods")


class DiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where a tier's replicas come from (serving/discovery.py). "static": the [[fleet.replicas]]
    of the tier. "dns": `name` re-resolved every interval_s, as A/AAAA records plus `port`, or as SRV
    records (target and port per replica) with srv = true."""

    kind: str = "static"
    name: str = ""
    port: int = 0                 # A/AAAA: the engines' HTTP port (SRV records carry their own)
    srv: bool = False
    nameservers: list[str] = []   # "host" or "host:port"; [] = the system's resolv.conf
    interval_s: float = 5.0
    timeout_s: float = 2.0        # per lookup, all nameservers tried
    kv_events_port: int = 0       # engines publish KV events on tcp://<address>:<port>; 0 = none
    cost_per_hour: str = "0"      # USD per discovered replica, a decimal string
    # kind = "kubernetes": the EndpointSlices (or pods) matching label_selector in namespace,
    # at the port named port_name (or `port`); api_server "" = in-cluster or $KUBECONFIG.
    namespace: str = ""
    label_selector: str = ""      # equality selectors, "app=vllm,tier=standard"
    port_name: str = ""
    resource: str = "endpointslices"
    api_server: str = ""

    def __post_init__(self) -> None:
        if self.kind not in DISCOVERY_KINDS:
            raise ValueError(f"discovery.kind must be one of {DISCOVERY_KINDS}, not {self.kind!r}")
        if self.kind == "kubernetes":
            self._check_kubernetes()
            return
        if self.kind != "dns":
            return
        if not self.name:
            raise ValueError("dns discovery needs a name")
        if not self.srv and not 0 < self.port < 65536:
            raise ValueError("dns discovery of A/AAAA records needs a port (1-65535), or srv = true")
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("discovery interval_s and timeout_s must be > 0")
        if not 0 <= self.kv_events_port < 65536:
            raise ValueError(f"discovery.kv_events_port must be 0-65535, not {self.kv_events_port}")
        for ns in self.nameservers:
            nameserver_address(ns)

    def _check_kubernetes(self) -> None:
        if not self.namespace or not self.label_selector:
            raise ValueError("kubernetes discovery needs a namespace and a label_selector")
        if not self.port_name and not 0 < self.port < 65536:
            raise ValueError("kubernetes discovery needs a port_name or a port (1-65535)")
        if self.resource not in KUBERNETES_RESOURCES:
            raise ValueError(f"discovery.resource must be one of {KUBERNETES_RESOURCES}, not {self.resource!r}")
        if any("=" not in part or "!" in part for part in self.label_selector.split(",") if part.strip()):
            raise ValueError(f"label_selector {self.label_selector!r}: only key=value selectors, comma-separated")
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("discovery interval_s and timeout_s must be > 0")


def nameserver_address(spec: str) -> tuple[str, int]:
    """"127.0.3.1:5353" -> ("127.0.3.1", 5353); "::1" or "[::1]:53" for IPv6; port 53 by default."""
    import ipaddress

    host, port = spec, "53"
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif spec.count(":") == 1:
        host, port = spec.split(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"nameserver {spec!r} must be an IP address with an optional :port") from None
    if not 0 < number < 65536:
        raise ValueError(f"nameserver {spec!r}: port out of range")
    return host, number


class TierConfig(msgspec.Struct, forbid_unknown_fields=True):
    policy: str = "cache_aware"   # a preset (cache/policies.py): cache_aware, round_robin, least_loaded, ...
    # Or a pipeline of registered parts (cache/policies.py), labelled `policy` in metrics.
    pipeline: PipelineSpec | None = None
    # cache_aware cost = overlap_weight * blocks_to_prefill + queued_request_blocks * load (unset:
    # overlap_weight = 1 + 1 / (replicas - 1)); replicas with load > max(spill_factor * others' mean,
    # mean + spill_slack) are skipped (see cache/scorers.py).
    overlap_weight: float | None = None
    queued_request_blocks: float = 2.0
    spill_factor: float = 2.0
    spill_slack: float = 2.5
    # ...and replicas past max(share_factor * mean, mean + share_slack) of recent picks, unless
    # they save >= share_keep_blocks blocks of prefill (long cached contexts stay home), or
    # share_keep_tail_blocks once a replica within its share holds >= share_spread_fraction of
    # their cached prefix (the shared head has spread; the rest is the request's own context).
    # A replica with more than share_seed_fraction of all recent picks (and share_seed_slack over
    # the mean) keeps nothing by its savings while the request's prefix is on no other replica.
    share_factor: float = 1.15
    share_slack: float = 4.0
    share_keep_blocks: int = 16
    share_keep_tail_blocks: int = 2
    share_spread_fraction: float = 0.3
    share_seed_fraction: float = 0.85
    share_seed_slack: float = 8.0
    # Prefill routed to a replica whose first token is not back yet counts this much per block.
    pending_weight: float = 0.25
    # Blocks added to a replica's cost per unit of its recent-pick share above the mean.
    share_weight: float = 4.0
    # A tier whose replicas (plain, same model) also take this tier's requests that speculation
    # would not speed up; the `speculation` filter of the tier's policy (`speculation_aware`)
    # decides per request. Such a request is priced and labelled as that tier. "" = none.
    plain_tier: str = ""
    # The speculation filter: requests sampled above this temperature go to plain replicas;
    # an unset temperature is the engine's default (docs/routing.md#speculation).
    speculate_max_temperature: float = 0.0
    default_temperature: float = 1.0
    # The tier that serves this tier's requests while none of its own replicas is routable (same
    # model); priced and labelled by the tier that served. "" = answer 503 instead.
    fallback: str = ""
    discovery: DiscoveryConfig = DiscoveryConfig()

    @property
    def discovered(self) -> bool:
        return self.discovery.kind != "static"

    def __post_init__(self) -> None:
        # An unknown policy or part name is a config error at start-up, not at the first request.
        build_parts(self.pipeline or preset(self.policy), RouterConfig())


class FleetConfig(msgspec.Struct, forbid_unknown_fields=True):
    # The name clients send; engines serve it as --served-model-name. "" = the model's own name
    # (serving/models.py: "smollm2", "tiny", or the directory's name).
    model: str = ""
    # What launched replicas load: "smollm2" (SmolLM2-135M-Instruct from the package index), "tiny"
    # (the generated random-weight Llama) or a Hugging Face directory; "" = smollm2.
    model_path: str = ""
    demo_model: DemoModelSpec = DemoModelSpec()  # the tiny model's shape (seed, sizes)
    block_size: int = 32          # KV block size in tokens (a multiple of 32 on CPU)
    tiers: dict[str, TierConfig] = {}
    replicas: list[ReplicaConfig] = []
    # With no replicas listed, the fleet is the demo fleet: two launched engines on these ports.
    demo_base_port: int = 8101
    demo_hosts: list[str] = []    # addresses of the demo engines (standard, fast); [] = 127.0.0.1
    demo_engine_args: list[str] = []
    # vLLM's tool-call parser for the demo engines (`--enable-auto-tool-choice --tool-call-parser`);
    # "hermes" reads the <tool_call>{json}</tool_call> blocks the demo chat template renders.
    # "" = no tool calling (vLLM refuses requests with tools and a tool_choice).
    demo_tool_call_parser: str = "hermes"
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    # A probe that times out ejects a healthy replica only after this many in a row: a busy engine on a
    # loaded host stalls for seconds (9 s seen at load 10), a dead one refuses the connection at once.
    health_timeouts_to_eject: int = 3
    scrape_interval_s: float = 2.0
    log_dir: str = ""             # engine logs; "" = <YIELDGATE_HOME>/logs
    supervision: SupervisionConfig = SupervisionConfig()
    lora: LoraConfig = LoraConfig()  # LoRA flags for every launched engine
    # Another model of the gateway that serves this one's requests while none of its replicas (nor
    # its fallback tier's) is routable; priced and labelled as the model that served. "" = 503.
    fallback_model: str = ""

    def __post_init__(self) -> None:
        self.model = self.model or served_name(self.model_path)
        discovered = sorted(t for t, c in self.tiers.items() if c.discovered)
        demo = not self.replicas and not discovered
        if demo:
            self.replicas = demo_replicas(self.demo_base_port, self.demo_engine_args, self.demo_tool_call_parser)
            for replica, host in zip(self.replicas, self.demo_hosts):
                replica.launch.host = host  # type: ignore[union-attr]
        if not self.tiers:
            present = sorted({r.tier for r in self.replicas})
            # Same model on both tiers: each serves the other's requests while it has no replica.
            self.tiers = {t: TierConfig(fallback=next((o for o in present if o != t), "")) for t in present}
            if demo:
                # The demo's fast engine speculates only where it pays: greedy requests. Sampled ones
                # go to the standard engine at the standard price (docs/routing.md#speculation);
                # vLLM 0.32 on CPU also samples garbage with n-gram drafts when a request's sampling
                # comes from the model's generation_config (SmolLM2's T 0.2), not from the request.
                self.tiers["fast"] = TierConfig(policy="speculation_aware", plain_tier="standard",
                                                fallback="standard")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError("replica names must be unique")
        for r in self.replicas:
            if r.tier not in TIERS:
                raise ValueError(f"replica {r.name!r}: unknown tier {r.tier!r} (one of {TIERS})")
        for name, tier in self.tiers.items():
            if tier.plain_tier and (tier.plain_tier == name or tier.plain_tier not in TIERS):
                raise ValueError(f"tier {name!r}: plain_tier must be another tier (one of {TIERS}), "
                                 f"not {tier.plain_tier!r}")
            if tier.plain_tier and "speculation" not in (tier.pipeline or preset(tier.policy)).filters:
                raise ValueError(f"tier {name!r}: plain_tier needs a policy with the speculation filter "
                                 "(speculation_aware), or every request could go to the plain tier")
            if tier.fallback and (tier.fallback == name or tier.fallback not in TIERS):
                raise ValueError(f"tier {name!r}: fallback must be another tier (one of {TIERS}), "
                                 f"not {tier.fallback!r}")
        for name in discovered:
            if name not in TIERS:
                raise ValueError(f"tier {name!r}: unknown tier (one of {TIERS})")
            listed = [r.name for r in self.replicas if r.tier == name]
            if listed:
                raise ValueError(f"tier {name!r} discovers its replicas ({self.tiers[name].discovery.kind}); "
                                 f"it cannot also list {listed} in [[fleet.replicas]]")
        if self.health_timeouts_to_eject < 1:
            raise ValueError("health_timeouts_to_eject must be at least 1")
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError("block_size must be a positive multiple of 16")

    def tier(self, name: str) -> TierConfig:
        return self.tiers.get(name) or TierConfig()

    def tier_names(self) -> list[str]:
        """Tiers with listed replicas or a discovery source (which may have none yet)."""
        return sorted({r.tier for r in self.replicas} | {t for t, c in self.tiers.items() if c.discovered})


# Shared by the demo engines. Prefix caching with cached-token counts in usage; KV events feed the
# precise prefix index; dev mode exposes /pause, /reset_prefix_cache and the weight-transfer API.
_COMMON_ARGS = [
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--gpu-memory-utilization", "0.3",
    "--max-model-len", "4096",
    "--max-num-seqs", "64",
    # Requests carry a `priority` (lower first): interactive 0, flex and batch lanes behind them.
    "--scheduling-policy", "priority",
    # The trainer bridge's weight-transfer backend (trainer_bridge.plugin): hot weight pushes.
    "--weight-transfer-config", '{"backend":"yieldgate"}',
]
# 8 drafts, not vLLM's usual 4: on CPU a speculative step costs ~2x a plain one even when nothing
# is accepted, so only long accepted runs pay (benchmarks/fast_vs_standard.py: greedy code edits
# 1.69x with 4, 2.05x with 8).
_SPEC_DECODE = (
    '{"method":"ngram","num_speculative_tokens":8,"prompt_lookup_max":4,"prompt_lookup_min":2}'
)


def demo_replicas(base_port: int, extra_args: list[str], tool_call_parser: str = "hermes") -> list[ReplicaConfig]:
    """One standard and one fast engine, each pinned to its own core of a 2-core machine."""
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser] if tool_call_parser else []
    extra = tools + list(extra_args)
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
