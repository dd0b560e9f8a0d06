"""The post-training loop on the real model: held-out success and $ per solved task before and
after up to 3 rounds, and what a round takes.

    python benchmarks/posttrain_loop.py [--runs 3] [--rounds 3] [--family arithmetic] [--engine URL]

Each run starts from the base model: a fresh adapter, round 0 (a zero LoRA: the base model's
answers) and `--rounds` rounds of `yieldgate posttrain`'s loop (trainer_bridge/posttrain.py)
against one SmolLM2 engine with LoRA and one gateway whose own timer judges every canary. Held-out
success has a 90% Wilson interval; $ per solved task the interval that success interval gives
(the spend per task hardly varies). Every run is kept in benchmarks/results/posttrain_loop.json;
the plot is posttrain_loop.png. Goals (issue #42): success >= 2x the base's (or +30 points where
the base is above 30%) and $ per solved <= 0.5x the base's, both at the 90% bounds; a round <= 10 min.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  benchmarks/harness.py

from yieldgate.gateway.config import Config, ServerConfig  # noqa: E402
from yieldgate.gateway.embedded import GatewayProcess, stop_process_group  # noqa: E402
from yieldgate.pricing.release_gate import CanaryGateConfig, wilson  # noqa: E402
from yieldgate.serving.config import FleetConfig, ReplicaConfig  # noqa: E402
from yieldgate.serving.smollm2 import SERVE_ARGS, ensure_smollm2  # noqa: E402
from yieldgate.trainer_bridge.posttrain import PosttrainLoop, PosttrainSettings, format_table  # noqa: E402

Z90 = 1.6449  # two-sided 90%
# The launcher's polling for the engine's processes (serving/engine_polling.py), and one compute
# thread: on a shared, oversubscribed host two OpenMP threads wait for each other at every barrier.
POLLING = {"YIELDGATE_ENGINE_POLL_PAUSE_US": "50", "YIELDGATE_ENGINE_POLL_SPIN_US": "300", "OMP_NUM_THREADS": "1"}
HOST = "127.0.11.5"
MODEL = "smollm2-posttrain"   # the served name: an adapter registry of its own in Redis
MEASURES = ["trainer_bridge/posttrain.py", "trainer_bridge/tasks.py", "pricing/release_gate.py", "serving/smollm2.py",
            "gateway/adapter_canary.py", "benchmarks/posttrain_loop.py"]


def start_engine(model_dir: Path, port: int, log: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_HOST_IP="127.0.0.1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
               **POLLING)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--host", HOST, "--port", str(port), "--gpu-memory-utilization", "0.3",
           "--block-size", "32", "--enforce-eager", "--enable-prefix-caching", "--max-model-len", "2048",
           "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", *SERVE_ARGS]  # float32 (serving/smollm2.py)
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError("engine not healthy after 900 s")


def interval(solved: int, n: int) -> list[float]:
    return [round(x, 4) for x in wilson(solved, n, Z90)]


def usd_interval(row: dict) -> list[float | None]:
    """$ per solved = spend per task / success rate; its interval from the success rate's."""
    if not row["eval_solved"]:
        return [None, None]
    per_task = row["usd_per_solved"] * row["eval_solved"] / row["eval_tasks"]
    low, high = wilson(row["eval_solved"], row["eval_tasks"], Z90)
    return [per_task / high, per_task / low if low > 0 else None]


def one_run(i: int, args, gateway: str, admin: str, model_dir: Path, home: Path) -> dict:
    adapter = f"bench-{args.family.replace('_', '-')}-{i}-{secrets.token_hex(3)}"
    settings = PosttrainSettings(
        gateway=gateway, admin_token=admin, model_dir=str(model_dir), adapter=adapter, families=[args.family],
        rounds=args.rounds, seed=i, samples_per_round=args.samples, eval_tasks=args.eval_tasks, canary=args.canary,
        decision_timeout_s=args.decision_timeout, state_path=str(home / f"{adapter}.json"))
    started = time.monotonic()
    done = PosttrainLoop(settings).run()
    print(format_table(done))
    rows = [msgspec.to_builtins(r) for r in done]
    for r in rows:
        r["eval_interval90"] = interval(r["eval_solved"], r["eval_tasks"])
        r["usd_per_solved_interval90"] = usd_interval(r)
    base, final = rows[0], rows[-1]
    return {"adapter": adapter, "rounds": rows, "base_success": base["eval_success"],
            "final_success": final["eval_success"], "base_usd_per_solved": base["usd_per_solved"],
            "final_usd_per_solved": final["usd_per_solved"], "final_serving": final["serving"],
            "promotions": sum(r["decision"] == "promote" for r in rows),
            "rollbacks": sum(r["decision"] == "rollback" for r in rows),
            "round_minutes": [round(r["seconds"] / 60, 2) for r in rows[1:]],
            "minutes": round((time.monotonic() - started) / 60, 2)}


def goals(runs: list[dict]) -> dict:
    out = []
    for run in runs:
        base, final = run["rounds"][0], run["rounds"][-1]
        b_low, b_high = base["eval_interval90"]
        f_low, _ = final["eval_interval90"]
        success = f_low >= 2 * b_high if b_high <= 0.3 else f_low >= b_high + 0.3
        b_usd, f_usd = base["usd_per_solved_interval90"], final["usd_per_solved_interval90"]
        cheaper = f_usd[1] is not None and b_usd[0] is not None and f_usd[1] <= 0.5 * b_usd[0]
        out.append({"success_goal": success, "usd_goal": cheaper,
                    "round_goal": all(m <= 10 for m in run["round_minutes"])})
    return {"per_run": out, "all_met": bool(out) and all(all(g.values()) for g in out)}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        xs = [r["round"] for r in run["rounds"]]
        ys = [r["eval_success"] for r in run["rounds"]]
        lo = [y - r["eval_interval90"][0] for y, r in zip(ys, run["rounds"])]
        hi = [r["eval_interval90"][1] - y for y, r in zip(ys, run["rounds"])]
        a.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=run["adapter"])
        for r in run["rounds"]:
            if r["decision"] in ("promote", "rollback"):
                a.annotate(r["decision"][0].upper(), (r["round"], r["eval_success"]), textcoords="offset points",
                           xytext=(4, 4))
        b.plot(xs, [r["usd_per_solved"] for r in run["rounds"]], marker="o", label=run["adapter"])
    a.set(xlabel="round (0 = base model)", ylabel="held-out success (90% interval)", ylim=(0, 1),
          title="success; P = promoted, R = rolled back")
    b.set(xlabel="round", ylabel="$ per solved task", title="$ per solved task (held-out)", yscale="log")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--family", default="arithmetic")
    ap.add_argument("--samples", type=int, default=96, help="graded requests of round 0")
    ap.add_argument("--eval-tasks", type=int, default=40)
    ap.add_argument("--canary", type=float, default=0.5)
    ap.add_argument("--decision-timeout", type=float, default=900.0)
    ap.add_argument("--min-graded", type=int, default=16, help="the gate's minimum graded tasks per version")
    ap.add_argument("--evaluate-s", type=float, default=5.0, help="the gateway's canary timer")
    ap.add_argument("--engine", default="", help="reuse a running SmolLM2 engine with LoRA (rank 8, 2 slots)")
    ap.add_argument("--port", type=int, default=20600)
    ap.add_argument("--out", type=Path, default=harness.RESULTS / "posttrain_loop.json")
    ap.add_argument("--append", action="store_true", help="keep the runs already in --out and add these")
    args = ap.parse_args()
    rec = harness.Recording("posttrain_loop", MEASURES, out=args.out)
    model_dir = ensure_smollm2()
    work = Path(tempfile.mkdtemp(prefix="yg-posttrain-"))
    engine, url = (None, args.engine) if args.engine else start_engine(model_dir, args.port, work / "engine.log")
    admin = "bench-" + secrets.token_hex(6)
    gate = CanaryGateConfig(evaluate_s=args.evaluate_s)
    gate.rule.min_graded = args.min_graded
    config = Config(server=ServerConfig(host=HOST, admin_token=admin, redis_url="redis://127.0.0.1:6379/1",
                                        data_dir=str(work / "data")),
                    fleet=FleetConfig(model=MODEL, model_path=str(model_dir), health_interval_s=0.5,
                                      replicas=[ReplicaConfig(name="smol-0", tier="standard", url=url)]),
                    canary=gate)
    os.environ["YIELDGATE_HOME"] = str(work)
    signal.signal(signal.SIGTERM, interrupted)  # a SIGTERM stops the gateway and engine it started
    gw = GatewayProcess(config, work, port=args.port + 1)
    runs = json.loads(args.out.read_text())["runs"] if args.append and args.out.exists() else []
    first = len(runs)
    try:
        for i in range(first, first + args.runs):
            runs.append(one_run(i, args, gw.url, admin, model_dir, work))
            rec.write(runs=runs, summary=summary(runs), setup=setup(args), goals=goals(runs))
    finally:
        gw.stop()
        if engine is not None:
            stop_process_group(engine)
    plot(runs, args.out.with_suffix(".png"))


def interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def summary(runs: list[dict]) -> dict:
    return {"runs": len(runs),
            "base_success": harness.summarize(r["base_success"] for r in runs),
            "final_success": harness.summarize(r["final_success"] for r in runs),
            "base_usd_per_solved": harness.summarize(r["base_usd_per_solved"] for r in runs),
            "final_usd_per_solved": harness.summarize(r["final_usd_per_solved"] for r in runs),
            "round_minutes": harness.summarize(m for r in runs for m in r["round_minutes"])}


def setup(args) -> str:
    return (f"one SmolLM2-135M engine (LoRA rank 8, 2 slots) and one gateway judging canaries every "
            f"{args.evaluate_s:g} s (one-sided 99.9% bounds, {args.min_graded} graded per version first); "
            f"family {args.family}, {args.eval_tasks} held-out tasks, {args.samples} graded requests in round 0, "
            f"canary share {args.canary:g}, up to {args.rounds} rounds")


if __name__ == "__main__":
    main()
