"""A fleet of "hosts" on one machine, each on a loopback address of its own: two gateway processes
(127.0.1.1, 127.0.1.2), vLLM engines (127.0.2.x), a Redis server of its own (127.0.3.2) and a
nameserver (dnsmasq, 127.0.3.1) whose SRV records list the engines. A load client spreads
streamed requests over the gateways that answer /readyz, as a Kubernetes Service would.

Used by tests/test_multihost.py (over the session stack's engines) and benchmarks/multihost.py
(which prints the drills' timeline).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx

from polling import exit_code, until
from test_discovery_dns import SRV_NAME, ZONE, Dnsmasq
from yieldgate.gateway.config import Config, ServerConfig
from streams import sse_lines
from yieldgate.gateway.embedded import GatewayProcess, http_status
from yieldgate.serving.config import DiscoveryConfig, FleetConfig, TierConfig

GATEWAY_HOSTS = ("127.0.1.1", "127.0.1.2")
DNS_HOST = "127.0.3.1"
REDIS_HOST = "127.0.3.2"
ADMIN = "multihost-admin-" + uuid.uuid4().hex[:8]
PEPPER = "multihost-pepper-" + uuid.uuid4().hex  # key hashes must agree across gateways


def ports(base: int) -> dict[str, int]:
    """The fleet's own ports, inside the suite's range (base + 401 ...)."""
    return {"gateway": base + 401, "redis": base + 402, "dns": base + 403}


class RedisServer:
    """redis-server on a loopback address of its own; append-only, so a restart keeps its data."""

    def __init__(self, workdir: Path, host: str, port: int):
        self.binary = shutil.which("redis-server")
        self.host, self.port, self.workdir = host, port, workdir
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> None:
        assert self.binary, "redis-server is not installed"
        self.proc = subprocess.Popen([self.binary, "--bind", self.host, "--port", str(self.port), "--save", "",
                                      "--appendonly", "yes", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if self._ping():
                return
            time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def _ping(self) -> bool:
        out = subprocess.run(["redis-cli", "-h", self.host, "-p", str(self.port), "ping"], capture_output=True)
        return out.stdout.strip() == b"PONG"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["redis-cli", "-h", self.host, "-p", str(self.port), "shutdown"], capture_output=True)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


@dataclass
class Engine:
    address: str   # "127.0.2.1"
    port: int

    @property
    def name(self) -> str:  # how DNS discovery names the replica
        return f"{self.address}:{self.port}"


class Fleet:
    """The hosts; `gateways[i]` is restarted in place (same address, port and data directory)."""

    def __init__(self, workdir: Path, engines: list[Engine], model: str, model_dir: Path, port_base: int):
        self.workdir, self.engines, self.model, self.model_dir = workdir, engines, model, model_dir
        self.ports = ports(port_base)
        self.dns = Dnsmasq(workdir / "dns", DNS_HOST)
        self.dns.port = self.ports["dns"]
        (workdir / "dns").mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(workdir / "redis", REDIS_HOST, self.ports["redis"])
        self.gateways: list[GatewayProcess | None] = [None, None]
        self.listed: list[Engine] = []

    def start(self, listed: list[Engine]) -> None:
        self.redis.start()
        self.set_dns(listed, start=True)
        for i in range(len(GATEWAY_HOSTS)):
            self.start_gateway(i)

    def set_dns(self, listed: list[Engine], start: bool = False) -> None:
        """The SRV records name exactly these engines (dnsmasq restarted with them)."""
        self.listed = list(listed)
        hosts = {f"engine-{e.address.replace('.', '-')}.{ZONE}": e.address for e in self.engines}
        srv = [(f"engine-{e.address.replace('.', '-')}.{ZONE}", e.port) for e in listed]
        if start:
            self.dns.start(hosts, srv=srv)
        else:
            self.dns.restart(srv=srv)

    def instance(self, i: int) -> str:
        return f"gw-{i + 1}"

    def config(self, i: int) -> Config:
        discovery = DiscoveryConfig(kind="dns", name=SRV_NAME, srv=True, nameservers=[self.dns.nameserver],
                                    interval_s=0.5, timeout_s=0.5)
        config = Config(
            server=ServerConfig(host=GATEWAY_HOSTS[i], admin_token=ADMIN, redis_url=self.redis.url,
                                data_dir=str(self.workdir / f"gateway-{i + 1}" / "data"),
                                instance_id=self.instance(i), drain_s=2.0, stop_timeout_s=60.0),
            fleet=FleetConfig(model=self.model, model_path=str(self.model_dir), replicas=[], health_interval_s=0.5,
                              tiers={"standard": TierConfig(discovery=discovery)}))
        ledger = config.pricing.ledger
        ledger.store, ledger.redis_url, ledger.redis_prefix = "redis", self.redis.url, "yg:ledger:"
        config.pricing.limits.redis_url = self.redis.url
        config.pricing.limits.key_pepper = PEPPER
        return config

    def start_gateway(self, i: int) -> GatewayProcess:
        gw = GatewayProcess(self.config(i), self.workdir / f"gateway-{i + 1}", port=self.ports["gateway"])
        self.gateways[i] = gw
        return gw

    def urls(self) -> list[str]:
        return [f"http://{h}:{self.ports['gateway']}" for h in GATEWAY_HOSTS]

    def admin(self, i: int, path: str) -> httpx.Response:
        return httpx.get(self.urls()[i] + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)

    def serving(self, i: int) -> set[str]:
        """Replicas gateway i routes to now."""
        try:
            listed = self.admin(i, "/admin/fleet").json()
        except (httpx.HTTPError, ValueError):
            return set()
        return {name for name, r in listed.items() if r.get("state") == "serving"}

    def ledger(self) -> dict[str, list[dict[str, str]]]:
        for i in range(len(GATEWAY_HOSTS)):
            try:
                resp = self.admin(i, "/admin/ledger.csv")
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                rows: dict[str, list[dict[str, str]]] = {}
                for row in csv.DictReader(io.StringIO(resp.text)):
                    rows.setdefault(row["request_id"], []).append(row)
                return rows
        raise AssertionError("no gateway answers /admin/ledger.csv")

    def stop(self) -> None:
        for gw in self.gateways:
            if gw is not None:
                gw.stop()
        self.dns.stop()
        self.redis.stop()


@dataclass
class Served:
    """One request as the client saw it."""

    gateway_url: str
    started: float
    ended: float = 0.0
    ok: bool = False
    request_id: str = ""
    gateway: str = ""          # x-yieldgate-gateway
    replica: str = ""
    cost: Decimal | None = None
    detail: str = ""


class Service:
    """What a Kubernetes Service does for the gateways: only those answering /readyz get new
    requests (polled every 0.2 s)."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.ready = list(urls)
        self._stop = threading.Event()
        self._next = 0
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.ready = [u for u in self.urls if http_status(u + "/readyz", timeout=1.0) == 200]

    def pick(self, avoid: str | None = None) -> str | None:
        choices = [u for u in self.ready if u != avoid] or ([] if avoid else list(self.ready))
        if not choices:
            return None
        self._next += 1
        return choices[self._next % len(choices)]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Load:
    """`workers` threads sending streamed chat requests through the Service, bounded in count and
    time. A connection refused (nothing reached a gateway) is sent to another gateway once, as a
    load balancer retries a failed connect, and kept in `resent`: a failure the re-send avoided, never
    merged into the request it became; anything else that is not a whole answer is a failure."""

    def __init__(self, service: Service, workers: int = 4, max_tokens: int = 64, max_requests: int = 2000,
                 max_s: float = 300.0):
        self.service, self.workers, self.max_tokens = service, workers, max_tokens
        self.max_requests, self.max_s = max_requests, max_s
        self.served: list[Served] = []
        self.resent: list[Served] = []   # refused connections, each sent again to another gateway
        self.inflight: list[Served] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(workers)]

    def start(self) -> None:
        self.started = time.monotonic()
        for t in self._threads:
            t.start()

    def stop(self) -> list[Served]:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        assert not any(t.is_alive() for t in self._threads), "a load worker did not finish"
        return self.served

    def inflight_on(self, url: str) -> int:
        with self._lock:
            return sum(1 for s in self.inflight if s.gateway_url == url)

    def _work(self, w: int) -> None:
        # A connection per request, as a Service balances connections: a pooled one would outlive
        # the gateway it was opened to.
        with httpx.Client(timeout=httpx.Timeout(120, connect=2),
                          limits=httpx.Limits(max_keepalive_connections=0)) as client:
            i = 0
            while not self._stop.is_set() and len(self.served) < self.max_requests \
                    and time.monotonic() - self.started < self.max_s:
                self._one(client, f"w{w}-{i}")
                i += 1

    def _one(self, client: httpx.Client, tag: str) -> None:
        url = self.service.pick()
        if url is None:
            time.sleep(0.05)
            return
        body = {"model": "demo", "stream": True, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"multihost {tag} {uuid.uuid4().hex}"}]}
        for attempt in range(2):
            s = Served(url, time.monotonic())
            with self._lock:
                self.inflight.append(s)
            try:
                self._stream(client, s, body)
            except httpx.ConnectError as exc:
                s.detail = f"connect: {exc}"
            except Exception as exc:
                s.detail = f"{type(exc).__name__}: {exc}"
            finally:
                s.ended = time.monotonic()
                with self._lock:
                    self.inflight.remove(s)
            if s.detail.startswith("connect") and attempt == 0:
                other = self.service.pick(avoid=url)
                if other is not None:  # nothing reached that gateway: another one takes it
                    with self._lock:
                        self.resent.append(s)
                    url = other
                    continue
            with self._lock:
                self.served.append(s)
            return

    def _stream(self, client: httpx.Client, s: Served, body: dict) -> None:
        with client.stream("POST", s.gateway_url + "/v1/chat/completions", json=body) as r:
            s.request_id = r.headers.get("x-request-id", "")
            s.gateway = r.headers.get("x-yieldgate-gateway", "")
            s.replica = r.headers.get("x-yieldgate-replica", "")
            if r.status_code != 200:
                r.read()
                s.detail = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            done = False
            for line in sse_lines(r):
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:], parse_float=Decimal)
                    if "error" in event:
                        s.detail = f"error event: {event['error'].get('message')}"
                    elif event.get("usage"):
                        if event["usage"]["completion_tokens"] == self.max_tokens:
                            s.cost = Decimal(event["usage"]["cost"]["total"])
            s.ok = done and s.cost is not None and not s.detail
            if not s.ok and not s.detail:
                s.detail = "stream ended without usage and [DONE]"


def failures(served: list[Served]) -> list[Served]:
    return [s for s in served if not s.ok]


def reconcile(fleet: Fleet, served: list[Served], timeout_s: float = 60.0) -> dict[str, int]:
    """Every answered request is in the shared ledger once, names the gateway that served it and
    costs what its client was told."""
    wanted = {s.request_id: s for s in served if s.ok}
    deadline = time.monotonic() + timeout_s
    while True:
        rows = fleet.ledger()
        if all(rid in rows for rid in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    missing = [rid for rid in wanted if rid not in rows]
    assert missing == [], f"{len(missing)} answered requests missing from the ledger"
    twice = [rid for rid in wanted if len(rows[rid]) != 1]
    assert twice == [], f"{len(twice)} requests recorded more than once"
    for rid, s in wanted.items():
        row = rows[rid][0]
        assert row["gateway"] == s.gateway, (rid, row["gateway"], s.gateway)
        assert Decimal(row["cost_total"]) == s.cost, (rid, row["cost_total"], s.cost)
    by_gateway: dict[str, int] = {}
    for s in wanted.values():
        by_gateway[s.gateway] = by_gateway.get(s.gateway, 0) + 1
    return by_gateway


def port_base() -> int:
    return int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000"))


# -- the drills: each runs load through the Service and returns what happened -------------------


@dataclass
class Drill:
    name: str
    served: list[Served] = field(default_factory=list)
    resent: list[Served] = field(default_factory=list)  # refused connections the client sent elsewhere
    timeline: list[tuple[float, str]] = field(default_factory=list)   # (seconds since start, event)
    numbers: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def mark(self, event: str) -> float:
        now = time.monotonic()
        self.timeline.append((round(now - self.t0, 2), event))
        return now

    def summary(self) -> dict:
        return {"requests": len(self.served), "failed": len(failures(self.served)),
                "refused_and_resent": len(self.resent), **self.numbers,
                "timeline": [f"{t:7.2f}s {e}" for t, e in self.timeline]}


def _load(fleet: Fleet, workers: int = 4) -> tuple[Service, Load]:
    service = Service(fleet.urls())
    service.start()
    load = Load(service, workers=workers)
    load.start()
    return service, load


def _end(drill: Drill, service: Service, load: Load) -> None:
    drill.served = load.stop()
    drill.resent = list(load.resent)
    service.stop()
    drill.mark(f"load stopped: {len(drill.served)} requests, {len(failures(drill.served))} failed")


def drill_sigterm(fleet: Fleet, victim: int = 0) -> Drill:
    """SIGTERM one gateway while streams are in flight on it; restart it afterwards."""
    drill = Drill("sigterm")
    url = fleet.urls()[victim]
    service, load = _load(fleet)
    until(lambda: load.inflight_on(url) >= 2, "streams in flight on the victim", attempts=600, pause_s=0.05)
    gw = fleet.gateways[victim]
    assert gw is not None
    drill.numbers["streams_in_flight_at_signal"] = load.inflight_on(url)
    signalled = drill.mark(f"SIGTERM {fleet.instance(victim)} ({load.inflight_on(url)} streams in flight on it)")
    gw.process.send_signal(15)
    until(lambda: url not in service.ready, "the Service drops the draining gateway", pause_s=0.05)
    drill.mark("the Service sees it not ready")
    drill.numbers["exit_code"] = exit_code(gw.process, 120, gw.log_path)
    drill.numbers["drain_s"] = round(drill.mark(f"{fleet.instance(victim)} exited "
                                                 f"{drill.numbers['exit_code']:.0f}") - signalled, 2)
    drill.numbers["signalled_at"] = signalled
    time.sleep(3)  # the other gateway alone takes the traffic
    _end(drill, service, load)
    fleet.start_gateway(victim)
    drill.mark(f"{fleet.instance(victim)} restarted")
    return drill


def drill_sigkill(fleet: Fleet, victim: int = 1) -> Drill:
    """SIGKILL one gateway under load; restart it on its data directory (its journal replays)."""
    drill = Drill("sigkill")
    url = fleet.urls()[victim]
    service, load = _load(fleet)
    until(lambda: load.inflight_on(url) >= 2, "streams in flight on the victim", attempts=600, pause_s=0.05)
    gw = fleet.gateways[victim]
    assert gw is not None
    sent = time.monotonic()
    gw.process.kill()
    gw.process.wait(10)  # a request sent before the process is gone may still reach it
    killed = drill.mark(f"SIGKILL {fleet.instance(victim)} ({load.inflight_on(url)} streams in flight on it)")
    drill.numbers["killed_at"] = killed
    time.sleep(3)
    _end(drill, service, load)
    # In flight on it: sent to it before it was gone, not over when the signal was sent.
    drill.numbers["in_flight_at_kill"] = sum(1 for s in drill.served if s.gateway_url == url
                                             and s.started < killed and s.ended > sent)
    fleet.start_gateway(victim)
    drill.mark(f"{fleet.instance(victim)} restarted on its data directory")
    return drill


def drill_engines(fleet: Fleet, a: Engine, b: Engine) -> Drill:
    """DNS lists a alone; b is added under load (time until it serves), then a is removed (its
    streams finish, nothing new reaches it). DNS lists both again at the end."""
    drill = Drill("dns")
    fleet.set_dns([a])
    for i in range(len(GATEWAY_HOSTS)):
        until(lambda: fleet.serving(i) == {a.name}, f"gateway {i + 1} routes to {a.name} alone")
    service, load = _load(fleet)
    time.sleep(2)
    added = drill.mark(f"DNS adds {b.name}")
    fleet.set_dns([a, b])
    until(lambda: any(s.replica == b.name for s in list(load.served) + list(load.inflight)),
          f"{b.name} gets a request", attempts=1200, pause_s=0.05)
    drill.numbers["admit_s"] = round(drill.mark(f"first request on {b.name}") - added, 2)
    for i in range(len(GATEWAY_HOSTS)):
        until(lambda: b.name in fleet.serving(i), f"gateway {i + 1} routes to {b.name}")
    time.sleep(2)
    until(lambda: any(s.replica == a.name for s in list(load.inflight)), f"streams in flight on {a.name}",
          pause_s=0.02)
    drill.numbers["in_flight_on_removed"] = sum(1 for s in list(load.inflight) if s.replica == a.name)
    removed = drill.mark(f"DNS drops {a.name}")
    fleet.set_dns([b])
    left_at = []
    for i in range(len(GATEWAY_HOSTS)):
        until(lambda: a.name not in fleet.serving(i), f"gateway {i + 1} stops routing to {a.name}",
              attempts=600, pause_s=0.05)
        left_at.append(drill.mark(f"{fleet.instance(i)} stops routing to {a.name}"))
    drill.numbers["leave_s"] = round(max(left_at) - removed, 2)
    drill.numbers["left_at"] = max(left_at)
    drill.numbers["removed_at"] = removed
    time.sleep(3)
    _end(drill, service, load)
    fleet.set_dns([a, b])
    for i in range(len(GATEWAY_HOSTS)):
        until(lambda: fleet.serving(i) == {a.name, b.name}, f"gateway {i + 1} routes to both engines")
    drill.mark("DNS lists both engines again; both gateways route to both")
    return drill


def drill_redis(fleet: Fleet, down_s: float = 8.0) -> Drill:
    """Redis restarted mid-run: both gateways keep serving (on_redis_error = open)."""
    drill = Drill("redis")
    service, load = _load(fleet)
    time.sleep(2)
    stopped = drill.mark("Redis stopped")
    fleet.redis.stop()
    time.sleep(down_s)
    fleet.redis.start()
    started = drill.mark("Redis started again")
    drill.numbers["stopped_at"], drill.numbers["started_at"] = stopped, started
    time.sleep(4)
    _end(drill, service, load)
    return drill
