"""The gateway: an OpenAI- and Anthropic-compatible HTTP front door (and an Envoy endpoint
picker) over the serving fleet, with keys, budgets, tiers, cost on every answer, and the admin,
weights and adapter APIs. Every front door is a transport over one request pipeline
(`Pipeline` / `Exchange`, gateway/exchange.py).

The face is lazy, as serving's is: `yieldgate --help` and the light CLI commands answer without
loading the web application.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "app": ["Gateway", "GatewayApp", "InsecureConfig", "create_app", "server_config"],
    "config": ["Config", "ConfigError", "PickerConfig", "RequestLimits", "ServerConfig", "load_config"],
    "embedded": ["EmbeddedGateway", "GatewayProcess"],
    "errors": ["APIError"],
    "exchange": ["Exchange", "Pipeline"],
    "picker": ["EndpointPicker", "envoy_config"],
})
