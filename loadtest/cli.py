"""`yieldgate loadtest` / `python -m yieldgate.loadtest`: run a seeded workload against one or more targets."""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections import deque
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import msgspec
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .load import Bounds, ConcurrencyLoad, Load, PoissonLoad, ReplayLoad, SweepLoad
from .config import LoadTestConfig, run_config
from .price import PriceTable
from .record import RequestRecord
from .report import print_summary, write_outputs
from .runner import SLO_KEYS, CacheSalt, run_compare
from .target import Target
from .workload import (
    AdapterWorkload,
    AgentSessionWorkload,
    AgentToolsWorkload,
    CodeEditWorkload,
    RandomLengthWorkload,
    SharedPrefixWorkload,
    TraceWorkload,
    Workload,
)

app = typer.Typer(add_completion=False, help="Load-test OpenAI-compatible endpoints (yieldgate gateway or vLLM).")


class WorkloadKind(str, Enum):
    shared_prefix = "shared-prefix"
    adapters = "adapters"
    agent = "agent"
    agent_tools = "agent-tools"
    random = "random"
    code_edit = "code-edit"
    trace = "trace"


class ApiKind(str, Enum):
    chat = "chat"
    completions = "completions"
    responses = "responses"
    messages = "messages"


class LoadKind(str, Enum):
    concurrency = "concurrency"
    poisson = "poisson"
    sweep = "sweep"
    replay = "replay"


_WORKLOADS: dict[WorkloadKind, type] = {
    WorkloadKind.shared_prefix: SharedPrefixWorkload,
    WorkloadKind.adapters: AdapterWorkload,
    WorkloadKind.agent: AgentSessionWorkload,
    WorkloadKind.agent_tools: AgentToolsWorkload,
    WorkloadKind.random: RandomLengthWorkload,
    WorkloadKind.code_edit: CodeEditWorkload,
    WorkloadKind.trace: TraceWorkload,
}


class CliError(ValueError):
    """A command-line value could not be understood."""


def _kv(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq:
            raise CliError(f"{what} wants key=value, got {item!r}")
        out[k.strip().replace("-", "_")] = v.strip()
    return out


def build_workload(kind: WorkloadKind, params: dict[str, Any], seed: int) -> Workload:
    cls = _WORKLOADS[kind]
    try:
        # strict=False converts "64" -> 64 for the typed fields: --param values arrive as strings.
        return msgspec.convert({"seed": seed, **params}, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise CliError(f"bad workload parameter for {kind.value}: {exc}") from exc


def build_targets(urls: list[str], models: list[str], bodies: list[str], *, api: str, stream: bool,
                  api_key: str | None, ignore_eos: bool) -> list[Target]:
    """Cross product of --target x --model x --body; `label=value` names a target or body variant."""
    targets: list[Target] = []
    for u in urls:
        ulabel, _, url = u.partition("=") if "=" in u.split("://")[0] else ("", "", u)
        for m in models or [_default_model(url)]:
            for b in bodies or [""]:
                blabel, body = "", b
                if b and not b.lstrip().startswith("{"):
                    blabel, _, body = b.partition("=")
                try:
                    extra = json.loads(body) if body else {}
                except json.JSONDecodeError as exc:
                    raise CliError(f"--body must be JSON: {exc}") from exc
                parts = [ulabel or (url if len(urls) > 1 else ""), m if len(models) > 1 else "",
                         blabel or (body if len(bodies) > 1 else "")]
                targets.append(Target(base_url=url, model=m, api=api, stream=stream, extra_body=extra,  # type: ignore[arg-type]
                                      api_key=api_key, ignore_eos=ignore_eos, name=" ".join(p for p in parts if p)))
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        for i, t in enumerate(targets):
            t.name = f"{i}:{t.label}"
    return targets


def _default_model(url: str) -> str:
    """First model the server lists, so `--model` can be omitted against a single-model engine."""
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        with urllib.request.urlopen(base + "/models", timeout=5) as resp:
            data = json.load(resp)["data"]
            return data[0]["id"]
    except Exception:  # noqa: BLE001 - any failure just means "use the default name"
        return "demo"


def build_load(kind: LoadKind, *, concurrency: int, rate: float, burstiness: float, rates: str | None,
               max_rate: float, max_concurrency: int | None, speedup: float) -> Load:
    if kind is LoadKind.concurrency:
        return ConcurrencyLoad(concurrency=concurrency)
    if kind is LoadKind.poisson:
        return PoissonLoad(rate=rate, burstiness=burstiness, max_concurrency=max_concurrency)
    if kind is LoadKind.replay:
        return ReplayLoad(speedup=speedup, max_concurrency=max_concurrency)
    parsed = [float(x) for x in rates.split(",")] if rates else None
    return SweepLoad(rates=parsed, start_rate=rate, max_rate=max_rate, burstiness=burstiness,
                     max_concurrency=max_concurrency)


class _LiveProgress:
    """Progress bar with running figures; updates are throttled to keep the client cheap."""

    def __init__(self, progress: Progress, total: int | None) -> None:
        self.progress = progress
        self.task = progress.add_task("", total=total)
        self.target = ""
        self.ok = self.failed = 0
        self.ttft: deque[float] = deque(maxlen=256)
        self.t0 = time.perf_counter()
        self._last = 0.0
        self.n = 0

    def phase(self, target: str, index: int, count: int) -> None:
        self.target = f"{target}" + (f" [{index + 1}/{count}]" if count > 1 else "")
        self.ok = self.failed = 0
        self.ttft.clear()
        self.t0 = time.perf_counter()
        self.describe()

    def record(self, rec: RequestRecord) -> None:
        self.n += 1
        if rec.ok:
            self.ok += 1
            if rec.ttft_ms is not None:
                self.ttft.append(rec.ttft_ms)
        else:
            self.failed += 1
        self.progress.update(self.task, advance=1)
        now = time.perf_counter()
        if now - self._last > 0.25:
            self._last = now
            self.describe()

    def describe(self) -> None:
        el = max(time.perf_counter() - self.t0, 1e-9)
        ttft = sorted(self.ttft)[len(self.ttft) // 2] if self.ttft else math.nan
        self.progress.update(self.task, description=(
            f"{self.target}  ok={self.ok} err={self.failed}  {self.ok / el:.1f} req/s  TTFT p50 {ttft:.0f} ms"))


@app.command()
def loadtest(
    target: Annotated[Optional[list[str]], typer.Option("--target", "-t", help="Base URL (repeat for several; label=URL names it).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="TOML/JSON LoadTestConfig; defines the whole run (only --out/--html/--progress still apply).")] = None,
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Model (repeat: demo, demo:fast). Default: server's first.")] = None,
    body: Annotated[Optional[list[str]], typer.Option("--body", help='Extra JSON body fields per variant, e.g. \'prio={"service_tier":"priority"}\' (repeat).')] = None,
    workload: Annotated[WorkloadKind, typer.Option("--workload", "-w")] = WorkloadKind.shared_prefix,
    param: Annotated[Optional[list[str]], typer.Option("--param", "-p", help="Workload field key=value, e.g. -p prefix_tokens=512 -p tenants=8.")] = None,
    input_tokens: Annotated[Optional[int], typer.Option(help="Shortcut for -p input_tokens=N (random).")] = None,
    output_tokens: Annotated[Optional[int], typer.Option(help="Shortcut for -p output_tokens=N.")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="JSONL trace for --workload trace.")] = None,
    api: Annotated[ApiKind, typer.Option(help="Wire format: chat, completions, responses (OpenAI Responses) or messages (Anthropic Messages).")] = ApiKind.chat,
    stream: Annotated[bool, typer.Option("--stream/--no-stream")] = True,
    ignore_eos: Annotated[bool, typer.Option(help="vLLM: always generate max_tokens.")] = False,
    load: Annotated[LoadKind, typer.Option("--load", "-l")] = LoadKind.concurrency,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c")] = 8,
    rate: Annotated[float, typer.Option(help="Poisson rate req/s (sweep: start rate).")] = 4.0,
    burstiness: Annotated[float, typer.Option(help="Gamma shape: 1 Poisson, <1 bursty.")] = 1.0,
    rates: Annotated[Optional[str], typer.Option(help="Sweep rates, comma separated (else start*2^k).")] = None,
    max_rate: Annotated[float, typer.Option(help="Sweep upper bound.")] = 256.0,
    max_concurrency: Annotated[Optional[int], typer.Option(help="Open loop: cap in-flight requests.")] = None,
    speedup: Annotated[float, typer.Option(help="Trace replay speed-up.")] = 1.0,
    requests: Annotated[Optional[int], typer.Option("--requests", "-n", help="Measured requests per target (per sweep step).")] = 100,
    duration: Annotated[Optional[float], typer.Option(help="Seconds per target (per sweep step).")] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up requests excluded from statistics.")] = 0,
    timeout: Annotated[float, typer.Option(help="Per-request timeout, s.")] = 120.0,
    slo: Annotated[Optional[list[str]], typer.Option(help="SLO bound, e.g. ttft_ms=500 tpot_ms=50 e2e_ms=2000 itl_ms=200.")] = None,
    price: Annotated[Optional[list[str]], typer.Option(help="USD/1M tokens: input=0.5,cached_input=0.05,output=1.5 (prefix MODEL: for one model).")] = None,
    price_file: Annotated[Optional[Path], typer.Option(help="TOML/JSON price table.")] = None,
    engine_metrics: Annotated[Optional[list[str]], typer.Option("--engine-metrics", help="Engine base URL to scrape /metrics before/after (repeat).")] = None,
    cache_salt: Annotated[Optional[str], typer.Option(help="Salt string, or 'auto' for a fresh one per target.")] = None,
    cache_salt_mode: Annotated[str, typer.Option(help="prefix, field (vLLM cache_salt) or both.")] = "prefix",
    order: Annotated[str, typer.Option(help="sequential or interleaved (targets take turns).")] = "sequential",
    rounds: Annotated[int, typer.Option(help="Interleaved: phases per target.")] = 4,
    seed: Annotated[int, typer.Option()] = 0,
    api_key: Annotated[Optional[str], typer.Option(envvar="YIELDGATE_API_KEY")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Directory for JSON/JSONL/CSV/HTML.")] = None,
    html: Annotated[bool, typer.Option("--html/--no-html")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Run a seeded workload against each target and compare."""
    console = Console()
    if config is not None:
        _run_config_file(config, console, out, html, progress)
        return
    if not target:
        console.print("[red]error:[/red] give --target URL (or --config FILE)")
        raise typer.Exit(2)
    try:
        params: dict[str, Any] = _kv(param or [], "--param")
        if input_tokens is not None:
            params["input_tokens"] = input_tokens
        if output_tokens is not None:
            params["output_tokens"] = output_tokens
        if trace is not None:
            params["path"] = str(trace)
        wl = build_workload(workload, params, seed)
        targets = build_targets(target, list(model or []), list(body or []), api=api.value, stream=stream,
                                api_key=api_key, ignore_eos=ignore_eos)
        ld = build_load(load, concurrency=concurrency, rate=rate, burstiness=burstiness, rates=rates,
                        max_rate=max_rate, max_concurrency=max_concurrency, speedup=speedup)
        bounds = Bounds(requests=requests, duration_s=duration, warmup_requests=warmup, timeout_s=timeout)
        slos = {k: float(v) for k, v in _kv(slo or [], "--slo").items()}
        if set(slos) - SLO_KEYS:
            raise CliError(f"--slo keys must be among {sorted(SLO_KEYS)}")
        prices = PriceTable.load(price_file) if price_file else None
        if price:
            extra = PriceTable.parse_cli(list(price))
            prices = PriceTable(prices={**(prices.prices if prices else {}), **extra.prices})
        salt: CacheSalt | str | None = None
        if cache_salt == "auto":
            salt = "auto"
        elif cache_salt:
            salt = CacheSalt(value=cache_salt, mode=cache_salt_mode)  # type: ignore[arg-type]
        if salt == "auto" and cache_salt_mode != "prefix":
            raise CliError("--cache-salt auto uses prefix mode; give an explicit salt for field mode")
    except (CliError, ValueError, OSError, msgspec.ValidationError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc

    meta = {"targets": [msgspec.to_builtins(t) | {"api_key": None} for t in targets],
            "workload": wl.describe(), "load": msgspec.to_builtins(ld), "bounds": msgspec.to_builtins(bounds),
            "slo": slos, "order": order, "seed": seed, "engine_metrics": list(engine_metrics or [])}
    kwargs: dict[str, Any] = dict(order=order, rounds=rounds, slo=slos, prices=prices,
                                  engine_metrics_urls=list(engine_metrics or []), cache_salt=salt, seed=seed)
    results = _with_progress(console, progress, _total(ld, bounds, len(targets)),
                             lambda **cb: run_compare(targets, wl, ld, bounds, **kwargs, **cb))
    _finish(results, console, out, meta, html)


def _total(ld: Load, bounds: Bounds, n_targets: int) -> int | None:
    if bounds.requests is None or bounds.duration_s is not None:
        return None
    steps = len(ld.schedule()) if isinstance(ld, SweepLoad) else 1
    return (bounds.requests + bounds.warmup_requests) * steps * n_targets


def _with_progress(console: Console, enabled: bool, total: int | None, run: Any) -> list:
    if not enabled:
        return run()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        live = _LiveProgress(bar, total)
        results = run(on_record=live.record, on_phase=live.phase)
        live.describe()
        return results


def _finish(results: list, console: Console, out: Path | None, meta: dict, html: bool) -> None:
    print_summary(results, console)
    if out is not None:
        paths = write_outputs(results, out, meta=meta, html_report=html)
        console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    if all(r.summary.completed == 0 for r in results):
        raise typer.Exit(1)


def _run_config_file(path: Path, console: Console, out: Path | None, html: bool, progress: bool) -> None:
    try:
        cfg = LoadTestConfig.load_file(path)
    except (OSError, ValueError, msgspec.ValidationError) as exc:
        console.print(f"[red]error:[/red] {path}: {exc}")
        raise typer.Exit(2) from exc
    results = _with_progress(console, progress, _total(cfg.load, cfg.bounds, len(cfg.targets)),
                             lambda **cb: run_config(cfg, **cb))
    meta = msgspec.to_builtins(cfg)
    for t in meta["targets"]:
        t["api_key"] = None
    out_dir = out or (Path(cfg.out_dir) if cfg.out_dir else None)
    _finish(results, console, out_dir, meta, html)


def run_cli(argv: list[str] | None = None) -> None:
    app(args=argv)


def main() -> None:
    app()
