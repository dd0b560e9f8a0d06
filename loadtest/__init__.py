"""yieldgate load tester: seeded workloads, load models, metrics and reports over plain HTTP.

    from yieldgate.loadtest import Target, SharedPrefixWorkload, ConcurrencyLoad, Bounds, run_load
    result = run_load(Target(base_url="http://127.0.0.1:8080", model="demo"),
                      SharedPrefixWorkload(), ConcurrencyLoad(concurrency=8), Bounds(requests=200))
    print(result.summary.ttft_ms.p(99), result.summary.cost_per_1m_tokens)
"""

from .client import OpenAIClient, RequestOutcome
from .config import LoadTestConfig, run_config
from .engine_metrics import EngineDelta, EngineMetricsError
from .load import Bounds, ConcurrencyLoad, Load, PoissonLoad, ReplayLoad, SweepLoad
from .price import Price, PriceTable
from .record import RequestRecord
from .report import print_summary, ratios, write_outputs
from .runner import CacheSalt, RunResult, Runner, arun_compare, arun_load, run_compare, run_load, turn_order
from .sse import SSEDecoder, SSEEvent
from .stats import Distribution, distribution, goodput, meets_slo, percentile, throughput_windows
from .summary import Summary, summarize
from .target import Target
from .wire import WIRES, Wire, WireUsage
from .workload import (
    AdapterWorkload,
    AgentSessionWorkload,
    AgentToolsWorkload,
    CodeEditWorkload,
    RandomLengthWorkload,
    Session,
    SharedPrefixWorkload,
    ToolCall,
    TraceWorkload,
    Turn,
    Workload,
    WorkloadError,
)

__all__ = [
    "AdapterWorkload", "AgentSessionWorkload", "AgentToolsWorkload", "Bounds", "CacheSalt", "CodeEditWorkload", "ConcurrencyLoad", "Distribution",
    "EngineDelta", "EngineMetricsError", "Load", "LoadTestConfig", "OpenAIClient", "PoissonLoad", "Price", "PriceTable",
    "RandomLengthWorkload", "ReplayLoad", "RequestOutcome", "RequestRecord", "RunResult", "Runner", "SSEDecoder", "SSEEvent",
    "Session", "SharedPrefixWorkload", "Summary", "SweepLoad", "Target", "ToolCall", "TraceWorkload", "Turn", "WIRES", "Wire", "WireUsage", "Workload",
    "WorkloadError", "arun_compare", "arun_load", "distribution", "goodput", "meets_slo", "percentile",
    "print_summary", "ratios", "run_compare", "run_config", "run_load", "summarize", "throughput_windows", "turn_order",
    "write_outputs",
]
