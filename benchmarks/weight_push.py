"""Weight-push throughput: yieldgate stream vs the loopback TCP limit vs a checkpoint reload.

Trainer and engine share this host, so pushes use the shared-memory transport (the trainer
writes into the engine's staging memory); every figure is also taken over TCP (`tcp_*`).

Generates a wider Llama (a few hundred MB), starts one engine serving it with the yieldgate
backend, then measures in the same run:
  * loopback TCP: one process sendall()s 8 MiB buffers to another that recv_into()s them;
  * stage: `stage()` -- the wire part of a push: stream + per-chunk xxh3 into the engine's
    registered buffers, verified, not loaded (what a rollout does while the engine serves);
  * push: `push_to_engine` -- one `/update_weights` round: stream + verify + load_weights
    (vLLM's layerwise reload, which on CPU re-packs every linear layer for oneDNN), each tensor
    loaded as soon as it is verified; push_sequential: the same with the load only after the
    whole stream is verified (`pipeline_load=False`), interleaved with it;
  * disk: write an HF checkpoint + `/collective_rpc reload_weights`, best of N.
The first update after engine start registers (allocates and pre-faults) the staging memory;
it is reported on its own and left out of the best-of-N figures.

    python benchmarks/weight_push.py [--hidden 1024 --layers 8 --port 21302 --repeats 3]
Writes benchmarks/results/weight_push.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import re
import statistics

import httpx
import torch

import harness  # benchmarks/harness.py, beside this script
from yieldgate.serving.demo_model import ensure_demo_model
from yieldgate.trainer_bridge import (
    WeightSet,
    apply_staged,
    arm_engine,
    push_to_engine,
    reload_from_checkpoint,
    stage,
    write_checkpoint,
)
from yieldgate.trainer_bridge.config import BridgeConfig

RESULTS = Path(__file__).parent / "results"


def make_model(out: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    demo = ensure_demo_model()
    config = LlamaConfig.from_pretrained(demo)
    config.hidden_size = hidden
    config.intermediate_size = int(hidden * 2.75)
    config.num_hidden_layers = layers
    config.num_attention_heads = hidden // 64
    config.num_key_value_heads = hidden // 128
    config.head_dim = 64
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (demo / name).exists():
            shutil.copy2(demo / name, out / name)
    return out


def _recv_sink(port: int, total: int, ready) -> None:
    with socket.create_server(("127.0.0.1", port)) as srv:
        ready.set()
        conn, _ = srv.accept()
        buf = memoryview(bytearray(8 << 20))
        got = 0
        while got < total:
            n = conn.recv_into(buf)
            if n == 0:
                break
            got += n
        conn.sendall(b"k")
        conn.close()


def loopback_gbps(total: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = mp.Event()
    proc = mp.Process(target=_recv_sink, args=(port, total, ready))
    proc.start()
    ready.wait()
    payload = memoryview(bytearray(os.urandom(1 << 20)) * 8)
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    sent = 0
    while sent < total:
        n = min(len(payload), total - sent)
        sock.sendall(payload[:n])
        sent += n
    sock.recv(1)
    seconds = time.perf_counter() - started
    sock.close()
    proc.join()
    return total / seconds / 1e9


def start_engine(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", PYTHONHASHSEED="0",
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--gpu-memory-utilization", "0.3", "--block-size", "32",
           "--max-model-len", "1024", "--enforce-eager",
           "--weight-transfer-config", '{"backend":"yieldgate"}']
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError("engine did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--port", type=int, default=21302)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", default=None, help="reuse a running engine serving the same model dir")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    load_start = os.getloadavg()[0]

    work = Path(tempfile.mkdtemp(prefix="yg-bench-"))
    model_dir = Path(args.model_dir) if args.model_dir else make_model(work / "model", args.hidden, args.layers)
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"model: {len(weights)} tensors, {total / 1e6:.0f} MB fp32")

    proc = None
    url = args.engine or f"http://127.0.0.1:{args.port}"
    log = work / "engine.log"
    if args.engine is None:
        proc = start_engine(model_dir, args.port, log)
    cfg = BridgeConfig()  # trainer and engine share this host: shared-memory transport
    cfg_tcp = BridgeConfig(shared_memory=False)
    cfg_sequential = BridgeConfig(pipeline_load=False)
    wset = WeightSet.from_model(weights, dtype=torch.float32)
    try:
        token = "bench-" + os.urandom(4).hex()
        arm_engine(url, token)
        first = push_to_engine(url, weights, "bench-first", token=token, dtype=torch.float32, config=cfg)
        tcp, stages, stage_walls, applies, pushes, sequential = [], [], [], [], [], []
        tcp_stages, tcp_pushes, transports = [], [], set()
        for i in range(args.repeats):
            tcp.append(loopback_gbps(total))
            started = time.perf_counter()
            sessions, transfer_s = stage(wset, [url], token, cfg)
            stages.append(transfer_s)
            stage_walls.append(time.perf_counter() - started)
            started = time.perf_counter()
            apply_staged(url, sessions[url], f"bench-staged-{i}", cfg)
            applies.append(time.perf_counter() - started)
            sessions, transfer_s = stage(wset, [url], token, cfg_tcp)
            tcp_stages.append(transfer_s)
            apply_staged(url, sessions[url], f"bench-staged-tcp-{i}", cfg)
            report = push_to_engine(url, weights, f"bench-{i}", token=token, dtype=torch.float32, config=cfg)
            pushes.append(report.transfer_seconds)
            transports.update(report.transports.values())
            report = push_to_engine(url, weights, f"bench-tcp-{i}", token=token, dtype=torch.float32,
                                    config=cfg_tcp)
            tcp_pushes.append(report.transfer_seconds)
            transports.update(f"tcp-run:{t}" for t in report.transports.values())
            report = push_to_engine(url, weights, f"bench-seq-{i}", token=token, dtype=torch.float32,
                                    config=cfg_sequential)
            sequential.append(report.transfer_seconds)
            print(f"[{i + 1}/{args.repeats}] loopback {tcp[-1]:.2f} GB/s; stage shm {stages[-1]:.3f} s, "
                  f"tcp {tcp_stages[-1]:.3f} s; apply {applies[-1]:.3f} s; push shm {pushes[-1]:.3f} s, "
                  f"tcp {tcp_pushes[-1]:.3f} s, shm load-after-stream {sequential[-1]:.3f} s", flush=True)
        reloads = []
        for i in range(args.repeats):
            started = time.perf_counter()
            ckpt = write_checkpoint(weights, model_dir, work / f"ckpt-{i}")
            written = time.perf_counter()
            reload_from_checkpoint(url, ckpt, f"disk-{i}")
            reloads.append((written - started, time.perf_counter() - written))
            shutil.rmtree(ckpt)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    # The engine logs its own split of every update: receive+verify, then load_weights.
    engine_split = [tuple(float(x) for x in m) for m in re.findall(
        r"received\+verified in ([0-9.]+)s, loaded in ([0-9.]+)s \(([0-9.]+)s waiting for chunks; "
        r"snapshot ([0-9.]+) MB in ([0-9.]+)s\)", log.read_text())] if log.exists() else []

    tcp_best = max(tcp)
    push_s, stage_s = min(pushes), min(stages)
    write_s, reload_s = min(reloads, key=lambda r: r[0] + r[1])
    result = {
        "model": {"hidden": args.hidden, "layers": args.layers, "tensors": len(weights), "bytes": total},
        "chunk_bytes": cfg.chunk_bytes,
        "checksum": cfg.checksum,
        "loopback_tcp_gbps": round(tcp_best, 3),
        "stage_seconds": round(stage_s, 3),
        "stage_gbps": round(total / stage_s / 1e9, 3),
        "stage_vs_loopback": round(total / stage_s / 1e9 / tcp_best, 3),
        "apply_seconds": round(min(applies), 3),
        "push_seconds": round(push_s, 3),
        "push_gbps": round(total / push_s / 1e9, 3),
        "push_vs_loopback": round(total / push_s / 1e9 / tcp_best, 3),
        "first_push_seconds": round(first.transfer_seconds, 3),
        "disk_write_seconds": round(write_s, 3),
        "disk_reload_seconds": round(reload_s, 3),
        "disk_total_seconds": round(write_s + reload_s, 3),
        "push_speedup_vs_disk": round((write_s + reload_s) / push_s, 2),
        "transport": "shm (same host; " + ", ".join(sorted(transports)) + ")",
        "tcp_stage_seconds": round(min(tcp_stages), 3),
        "tcp_stage_vs_loopback": round(total / min(tcp_stages) / 1e9 / tcp_best, 3),
        "tcp_push_seconds": round(min(tcp_pushes), 3),
        "tcp_push_vs_loopback": round(total / min(tcp_pushes) / 1e9 / tcp_best, 3),
        "all_tcp_stage_seconds": [round(x, 3) for x in tcp_stages],
        "all_tcp_push_seconds": [round(x, 3) for x in tcp_pushes],
        "push_sequential_seconds": round(min(sequential), 3),
        "push_sequential_vs_loopback": round(total / min(sequential) / 1e9 / tcp_best, 3),
        "all_push_sequential_seconds": [round(x, 3) for x in sequential],
        "all_loopback_gbps": [round(g, 3) for g in tcp],
        "all_stage_seconds": [round(x, 3) for x in stages],
        "all_stage_wall_seconds": [round(x, 3) for x in stage_walls],
        "all_apply_seconds": [round(x, 3) for x in applies],
        "all_push_seconds": [round(x, 3) for x in pushes],
        "median_push_seconds": round(statistics.median(pushes), 3),
        "all_disk_seconds": [[round(a, 3), round(b, 3)] for a, b in reloads],
        "engine_receive_load_wait_snapshot": [[round(x, 3) for x in row] for row in engine_split],
        "cpus": os.cpu_count(),
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": os.getloadavg()[0],
        "note": ("stage/push/apply/push_sequential use the shared-memory transport (trainer and engine on "
                 "one host: chunks written into the engine's memfd staging arena, signed headers over TCP, "
                 "xxh3 on both ends); tcp_* the same over loopback TCP (BridgeConfig(shared_memory=False)). "
                 "loopback = best of the runs interleaved with the pushes; stage = the /update_weights "
                 "round of a staged push: stream + xxh3 per chunk into the engine's registered buffers, "
                 "verified, status back (stage_wall adds /start_weight_update and client set-up); "
                 "push = one /update_weights round: stream + verify + load_weights (layerwise reload, oneDNN "
                 "re-pack on CPU); first_push includes registering (allocating + pre-faulting) the "
                 "staging memory; engine_receive_load_wait_snapshot: the engine's own log per update: "
                 "receive+verify s, load s (from the first verified tensor, incl. waiting), of which "
                 "waiting for chunks s, snapshot MB, snapshot s"),
    }
    result = {"meta": harness.meta(["trainer_bridge/", "serving/", "benchmarks/weight_push.py"],
                                   load_before=result.get("load_avg_1m_start")), **result}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "weight_push.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
