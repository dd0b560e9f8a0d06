"""Weight-push throughput: yieldgate stream vs the loopback TCP limit vs a checkpoint reload.

Generates a wider Llama (a few hundred MB), starts one engine serving it with the yieldgate
backend, then measures in the same run:
  * loopback TCP: one process sendall()s 8 MiB buffers to another that recv_into()s them;
  * push: `push_to_engine` (stream + checksum + staging + load_weights), best of N;
  * disk: write an HF checkpoint + `/collective_rpc reload_weights`, best of N.

    python benchmarks/weight_push.py [--hidden 1024 --layers 8 --port 8302 --repeats 3]
Writes benchmarks/results/weight_push-<date>.json.
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

import httpx
import torch

from serving.demo_model import ensure_demo_model
from trainer_bridge import arm_engine, push_to_engine, reload_from_checkpoint, write_checkpoint
from trainer_bridge.config import BridgeConfig

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
    ap.add_argument("--port", type=int, default=8302)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", default=None, help="reuse a running engine serving the same model dir")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="yg-bench-"))
    model_dir = Path(args.model_dir) if args.model_dir else make_model(work / "model", args.hidden, args.layers)
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"model: {len(weights)} tensors, {total / 1e6:.0f} MB fp32")

    proc = None
    url = args.engine or f"http://127.0.0.1:{args.port}"
    if args.engine is None:
        proc = start_engine(model_dir, args.port, work / "engine.log")
    try:
        token = "bench-" + os.urandom(4).hex()
        arm_engine(url, token)
        tcp = max(loopback_gbps(total) for _ in range(args.repeats))
        cfg = BridgeConfig()
        pushes = []
        for i in range(args.repeats):
            report = push_to_engine(url, weights, f"bench-{i}", token=token, dtype=torch.float32, config=cfg)
            pushes.append(report.transfer_seconds)
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

    push_s = min(pushes)
    write_s, reload_s = min(reloads, key=lambda r: r[0] + r[1])
    result = {
        "model": {"hidden": args.hidden, "layers": args.layers, "tensors": len(weights), "bytes": total},
        "chunk_bytes": cfg.chunk_bytes,
        "checksum": cfg.checksum,
        "loopback_tcp_gbps": round(tcp, 3),
        "push_seconds": round(push_s, 3),
        "push_gbps": round(total / push_s / 1e9, 3),
        "push_vs_loopback": round(total / push_s / 1e9 / tcp, 3),
        "disk_write_seconds": round(write_s, 3),
        "disk_reload_seconds": round(reload_s, 3),
        "disk_total_seconds": round(write_s + reload_s, 3),
        "push_speedup_vs_disk": round((write_s + reload_s) / push_s, 2),
        "all_push_seconds": [round(s, 3) for s in pushes],
        "all_disk_seconds": [[round(a, 3), round(b, 3)] for a, b in reloads],
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "note": "push = HTTP update_weights round: stream + crc32 verify + staging + load_weights",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"weight_push-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
