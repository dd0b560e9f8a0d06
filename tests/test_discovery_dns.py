"""Replicas discovered through DNS while the gateway serves: a real dnsmasq the test starts on its
own loopback address answers A records from a hosts file (reloaded on SIGHUP) and SRV records
(restarted with new --srv-host options); the SRV targets are the session stack's two real engines.
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import dns.exception
import dns.nameserver
import dns.resolver
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from needs import missing
from polling import until
from yieldgate.gateway.config import Config, ConfigError, ServerConfig, load_config
from yieldgate.serving.config import DiscoveryConfig, FleetConfig, ReplicaConfig, TierConfig
from yieldgate.serving.discovery import Discovery, DiscoveryError, DnsSource, StaticSource
from yieldgate.serving.fleet import Fleet

DNS_ADDRESS = "127.0.3.1"   # the test's nameserver, on a loopback address of its own
ZONE = "yg.test"
SRV_NAME = f"_vllm._tcp.pool.{ZONE}"
ADMIN = "discovery-admin-" + uuid.uuid4().hex[:8]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free for both UDP and TCP on `host` (dnsmasq listens on both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind((host, 0))
            port = udp.getsockname()[1]
            with socket.socket() as tcp:
                try:
                    tcp.bind((host, port))
                except OSError:
                    continue
                return port


class Dnsmasq:
    """dnsmasq answering only for yg.test, from a hosts file and --srv-host options; it forwards
    nothing (no upstream servers), so no query leaves the loopback address."""

    def __init__(self, workdir: Path, address: str = DNS_ADDRESS):
        self.binary = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")
        if self.binary is None:
            missing("dnsmasq is not installed (apt-get install dnsmasq-base; scripts/dev test installs it)")
        self.address, self.port = address, free_port(address)
        self.hosts_file = workdir / "hosts"
        self.proc: subprocess.Popen | None = None
        self.srv: list[tuple[str, int]] = []

    @property
    def nameserver(self) -> str:
        return f"{self.address}:{self.port}"

    def write_hosts(self, hosts: dict[str, str]) -> None:
        self.hosts_file.write_text("".join(f"{ip} {name}\n" for name, ip in hosts.items()))

    def start(self, hosts: dict[str, str] | None = None, srv: list[tuple[str, int]] = ()) -> None:
        """srv: (target, port) records of SRV_NAME."""
        if hosts is not None:
            self.write_hosts(hosts)
        self.srv = list(srv)
        args = [self.binary, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
                "--no-poll", f"--addn-hosts={self.hosts_file}", f"--listen-address={self.address}",
                "--bind-interfaces", f"--port={self.port}", f"--user={getpass.getuser()}", "--pid-file=",
                f"--local=/{ZONE}/", "--log-facility=-"]
        args += [f"--srv-host={SRV_NAME},{target},{port}" for target, port in self.srv]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        resolver = self.resolver()
        for _ in range(100):  # up within ~10 s, or fail
            try:
                resolver.resolve(f"up-check.{ZONE}", "A")
            except dns.resolver.NXDOMAIN:
                return  # it answers
            except dns.exception.DNSException:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"dnsmasq exited with {self.proc.returncode}")
                time.sleep(0.1)
        raise RuntimeError("dnsmasq did not answer")

    def resolver(self) -> dns.resolver.Resolver:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(self.address, self.port)]
        resolver.lifetime = 0.2
        return resolver

    def reload_hosts(self, hosts: dict[str, str]) -> None:
        self.write_hosts(hosts)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def restart(self, srv: list[tuple[str, int]]) -> None:
        self.stop()
        self.start(srv=srv)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def dnsmasq(tmp_path):
    server = Dnsmasq(tmp_path)
    yield server
    server.stop()


# -- the DNS source against a real nameserver -------------------------------------------------


def test_a_records_follow_the_hosts_file_and_a_missing_name_is_an_error_not_an_empty_set(dnsmasq):
    dnsmasq.start({f"pool.{ZONE}": "127.0.0.1"})
    source = DnsSource("standard", DiscoveryConfig(kind="dns", name=f"pool.{ZONE}", port=8101,
                                                  nameservers=[dnsmasq.nameserver], kv_events_port=5557))
    found = asyncio.run(source.resolve())
    assert [(r.name, r.url, r.tier, r.kv_events_endpoint) for r in found] == [
        ("127.0.0.1:8101", "http://127.0.0.1:8101", "standard", "tcp://127.0.0.1:5557")]

    # One more address for the name: both are replicas once dnsmasq has re-read its hosts file.
    dnsmasq.hosts_file.write_text(f"127.0.0.1 pool.{ZONE}\n127.0.0.2 pool.{ZONE}\n")
    dnsmasq.proc.send_signal(signal.SIGHUP)
    until(lambda: len(asyncio.run(source.resolve())) == 2, "the second address is served")
    assert [r.name for r in asyncio.run(source.resolve())] == ["127.0.0.1:8101", "127.0.0.2:8101"]

    dnsmasq.reload_hosts({})
    until(lambda: _fails(source), "the name stops resolving")
    with pytest.raises(DiscoveryError) as err:
        asyncio.run(source.resolve())
    assert err.value.reason == "nxdomain"


def _fails(source: DnsSource) -> bool:
    try:
        asyncio.run(source.resolve())
    except DiscoveryError:
        return True
    return False


def test_srv_records_give_each_target_and_port_and_a_dead_nameserver_times_out(dnsmasq):
    dnsmasq.start({f"engine-a.{ZONE}": "127.0.0.1", f"engine-b.{ZONE}": "127.0.0.1"},
                  srv=[(f"engine-a.{ZONE}", 9001), (f"engine-b.{ZONE}", 9002), (f"gone.{ZONE}", 9003)])
    source = DnsSource("fast", DiscoveryConfig(kind="dns", name=SRV_NAME, srv=True, timeout_s=0.5,
                                              nameservers=[dnsmasq.nameserver]))
    # A target without an address (gone.yg.test) is no replica; the others are, by address:port.
    assert [(r.name, r.url) for r in asyncio.run(source.resolve())] == [
        ("127.0.0.1:9001", "http://127.0.0.1:9001"), ("127.0.0.1:9002", "http://127.0.0.1:9002")]
    dnsmasq.stop()
    with pytest.raises(DiscoveryError) as err:
        asyncio.run(source.resolve())
    assert err.value.reason == "timeout"


def test_a_nameserver_answering_garbage_gives_a_failed_lookup_not_a_crash():
    class Garbage(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.transport = transport

        def datagram_received(self, data, addr):  # the query's id, then bytes that are no DNS message
            self.transport.sendto(data[:2] + b"\x81\x80\x00\x01\x00\x01not dns", addr)

    async def run():
        address = "127.0.4.1"
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            Garbage, local_addr=(address, free_port(address)))
        try:
            source = DnsSource("standard", DiscoveryConfig(
                kind="dns", name=SRV_NAME, srv=True, timeout_s=0.5,
                nameservers=[f"{address}:{transport.get_extra_info('sockname')[1]}"]))
            await source.resolve()
        finally:
            transport.close()

    with pytest.raises(DiscoveryError) as err:
        asyncio.run(run())
    assert err.value.reason in ("timeout", "unreadable", "servfail")


def test_a_failed_lookup_keeps_the_last_good_set_and_counts_the_failure():
    class Flaky:
        tier, label = "standard", "flaky"

        def __init__(self):
            self.answers: list = [[ReplicaConfig(name="a:1", url="http://127.0.0.1:1")],
                                  DiscoveryError("nxdomain", "gone"), []]

        async def resolve(self):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            if not answer:
                raise DiscoveryError("empty", "lists no replica")
            return answer

    handed: list[list[str]] = []
    failures: list[tuple[str, str]] = []

    async def reconcile(tier, source, found):
        handed.append([r.name for r in found])

    async def run():
        source = Flaky()
        discovery = Discovery([source], reconcile)
        discovery.on_failure = lambda tier, reason: failures.append((tier, reason))
        for _ in range(3):
            await discovery.refresh(source)
        return discovery.status["standard"]

    status = asyncio.run(run())
    assert handed == [["a:1"]]  # the fleet was never handed the failed or empty answers
    assert failures == [("standard", "nxdomain"), ("standard", "empty")]
    assert (status.stale, status.replicas, status.failures, status.lookups) == (True, 1, 2, 3)


def test_a_replica_joins_only_once_it_answers_and_serves_the_fleets_model(stack):
    """Fleet.reconcile against a real engine: a wrong served model or a dead port keeps a found
    replica joining (no traffic, the reason in its note); the right model lets it join with its
    KV capacity read; a replica no longer found leaves."""
    dead, engine = f"127.0.0.1:{free_port()}", stack.engines["standard"].removeprefix("http://")
    found = [ReplicaConfig(name=n, url=f"http://{n}") for n in (dead, engine)]

    async def run(model: str):
        import aiohttp

        fleet = Fleet(FleetConfig(model=model, replicas=[], health_timeout_s=2, tiers={
            "standard": TierConfig(discovery=DiscoveryConfig(kind="dns", name=SRV_NAME, srv=True,
                                                             nameservers=[f"{DNS_ADDRESS}:9"]))}))
        fleet._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        try:
            await fleet.reconcile("standard", "dns:test", await StaticSource("standard", found).resolve())
            seen = {n: (r.state, r.note, r.kv_capacity_blocks) for n, r in fleet.replicas.items()}
            candidates = [r.name for r in fleet.candidates("standard")]
            await fleet.reconcile("standard", "dns:test", [])
            for _ in range(50):  # drained: nothing in flight, so within a few polls
                if not fleet.replicas:
                    break
                await asyncio.sleep(0.1)
            return seen, candidates, list(fleet.replicas)
        finally:
            await fleet._session.close()

    seen, candidates, left = asyncio.run(run("another-model"))
    assert candidates == [] and left == []
    state, note, _ = seen[engine]
    assert state == "joining" and "'demo'" in note and note.endswith("not 'another-model'"), note
    assert seen[dead][0] == "joining" and seen[dead][1].startswith("joining: unreachable")

    seen, candidates, left = asyncio.run(run(stack.model))
    assert candidates == [engine] and left == []
    assert seen[engine][0] == "serving" and seen[engine][2] > 0


def test_discovery_settings_are_checked_at_load(tmp_path):
    path = tmp_path / "yieldgate.toml"
    bad = {
        'kind = "dns"\nname = "pool.yg.test"': "needs a port",
        'kind = "consul"': "discovery.kind must be one of",
        'kind = "dns"\nname = "x"\nsrv = true\nnameservers = ["resolver.example"]': "must be an IP address",
    }
    for body, message in bad.items():
        path.write_text(f"[fleet.tiers.standard.discovery]\n{body}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path, env={})
    path.write_text('[[fleet.replicas]]\nname = "s"\ntier = "standard"\nurl = "http://127.0.0.1:1"\n'
                    '[fleet.tiers.standard.discovery]\nkind = "dns"\nname = "x"\nsrv = true\n')
    with pytest.raises(ConfigError, match="cannot also list"):
        load_config(path, env={})
    path.write_text('[fleet.tiers.standard.discovery]\nkind = "dns"\nname = "_vllm._tcp.pool.yg.test"\n'
                    'srv = true\nnameservers = ["127.0.3.1:5353", "[::1]:53"]\n')
    fleet = load_config(path, env={}).fleet
    assert fleet.replicas == [] and fleet.tier_names() == ["standard"]  # no demo fleet added


# -- a gateway whose standard tier is discovered, in front of the stack's real engines ---------


@dataclass
class Served:
    started: float
    ended: float
    replica: str
    ok: bool
    detail: str = ""


def gateway_config(stack, redis_url: str, tmp_path: Path, dnsmasq: Dnsmasq, kv_port: int) -> Config:
    discovery = DiscoveryConfig(kind="dns", name=SRV_NAME, srv=True, nameservers=[dnsmasq.nameserver],
                                interval_s=0.3, timeout_s=0.3, kv_events_port=kv_port)
    return Config(
        server=ServerConfig(admin_token=ADMIN, redis_url=redis_url, data_dir=str(tmp_path / "data")),
        fleet=FleetConfig(model=stack.model, model_path=str(stack.model_dir), replicas=[], health_interval_s=0.5,
                          tiers={"standard": TierConfig(discovery=discovery)}))


def admin_get(url: str, path: str) -> dict:
    resp = httpx.get(url + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def metric(url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


async def one_request(client: openai.AsyncOpenAI, i: int, max_tokens: int = 48) -> Served:
    started = time.monotonic()
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="demo", max_tokens=max_tokens, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"request {i}: {uuid.uuid4().hex} " * 8}])
        completion = raw.parse()
        ok = completion.usage.completion_tokens == max_tokens
        return Served(started, time.monotonic(), raw.headers.get("x-yieldgate-replica", ""), ok)
    except openai.APIError as exc:
        return Served(started, time.monotonic(), "", False, f"{type(exc).__name__}: {exc}")


def test_engines_join_and_leave_a_serving_gateway_as_dns_says(stack, redis_url, tmp_path, dnsmasq,
                                                               gateway_factory, caplog):
    caplog.set_level(logging.WARNING, logger="yieldgate.discovery")
    a, b = stack.engines["standard"].removeprefix("http://"), stack.engines["fast"].removeprefix("http://")
    (host_a, port_a), (host_b, port_b) = a.rsplit(":", 1), b.rsplit(":", 1)
    target_a, target_b = (f"engine-a.{ZONE}", int(port_a)), (f"engine-b.{ZONE}", int(port_b))
    dnsmasq.start({f"engine-a.{ZONE}": host_a, f"engine-b.{ZONE}": host_b}, srv=[target_a])
    kv_port = free_port()
    gw = gateway_factory(gateway_config(stack, redis_url, tmp_path, dnsmasq, kv_port))
    fleet, routing = gw.gateway.fleet, gw.gateway.routing

    def client() -> openai.AsyncOpenAI:  # one per event loop: pooled connections belong to their loop
        return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    # Started with the one engine DNS names: probed (model, KV capacity) and serving.
    listed = admin_get(gw.url, "/admin/fleet")
    assert list(listed) == [a]
    assert listed[a]["source"] == f"dns:srv:{SRV_NAME}" and listed[a]["state"] == "serving"
    assert listed[a]["kv_capacity_blocks"] > 0
    assert routing.subscribers[a].endpoint == f"tcp://{host_a}:{kv_port}"

    # DNS adds the second engine: it joins, then gets requests.
    dnsmasq.restart(srv=[target_a, target_b])
    until(lambda: admin_get(gw.url, "/admin/fleet").get(b, {}).get("state") == "serving", "b joins")
    assert b in routing.subscribers and metric(
        gw.url, "yieldgate_replica_membership_changes_total", tier="standard", change="joined") == 2

    async def until_both_served() -> list[Served]:
        served: list[Served] = []
        openai_client = client()
        for i in range(30):  # cache-aware picks spread distinct prompts over both replicas
            served.append(await one_request(openai_client, i))
            if {s.replica for s in served} == {a, b}:
                break
        return served

    warmup = asyncio.run(until_both_served())
    assert all(s.ok for s in warmup), [s.detail for s in warmup if not s.ok]
    assert {s.replica for s in warmup} == {a, b}
    assert a in routing.index.stats().replicas  # the index holds prefixes routed to a

    # DNS drops engine a while requests are in flight on it.
    marks: dict[str, float | int] = {}
    in_flight_when_dropped: list[int] = []

    async def dropped(replica) -> None:
        in_flight_when_dropped.append(replica.inflight)

    fleet.on_leave.append(dropped)
    leave = fleet.leave

    def leave_and_mark(replica, why: str) -> None:
        # The moment discovery takes a out of routing: its in-flight count then, not after a poll
        # (its last requests may finish within one).
        marks["leave_seen"], marks["inflight_at_leave"] = time.monotonic(), replica.inflight
        leave(replica, why)

    fleet.leave = leave_and_mark

    async def load() -> list[Served]:
        served: list[Served] = []
        done = asyncio.Event()
        openai_client = client()

        async def worker(w: int) -> None:
            for i in range(40):  # bounded: at most 4 x 40 requests
                if done.is_set():
                    return
                served.append(await one_request(openai_client, 1000 * w + i))
                after = [s for s in served if "leave_seen" in marks and s.started > marks["leave_seen"]]
                if len(after) >= 12:
                    done.set()

        async def long_requests() -> None:
            # Two long answers at once: least-loaded spreads them, so one is in flight on a for
            # seconds, longer than discovery takes to see a unlisted.
            served.extend(await asyncio.gather(*(one_request(openai_client, 9000 + i, 3000) for i in range(2))))

        async def drop_a() -> None:
            for _ in range(1000):
                if fleet.replicas[a].inflight > 0:
                    break
                await asyncio.sleep(0.01)
            await asyncio.to_thread(dnsmasq.restart, [target_b])

        await asyncio.gather(long_requests(), drop_a(), *(worker(w) for w in range(4)))
        return served

    served = asyncio.run(load())
    leave_seen = marks["leave_seen"]
    failed = [s.detail for s in served if not s.ok]
    assert failed == []
    after = [s for s in served if s.started > leave_seen]
    assert len(after) >= 12 and {s.replica for s in after} == {b}  # nothing new went to a
    # a had requests in flight when it left; each finished (all requests above are ok).
    assert marks["inflight_at_leave"] > 0
    assert [s for s in served if s.replica == a and s.ended > leave_seen]
    until(lambda: a not in fleet.replicas, "a is dropped once drained")
    # Dropped only once drained, with its KV-event subscriber and its prefix-index entries.
    assert (in_flight_when_dropped, a in routing.subscribers, a in routing.index.stats().replicas) == ([0], False, False)
    assert list(admin_get(gw.url, "/admin/fleet")) == [b]
    assert metric(gw.url, "yieldgate_replica_membership_changes_total", tier="standard", change="left") == 1

    # DNS fails: first the name is gone (NXDOMAIN), then the nameserver is down. The fleet keeps b.
    caplog.clear()
    dnsmasq.restart(srv=[])
    until(lambda: admin_get(gw.url, "/admin/discovery")["standard"]["last_error"].startswith("nxdomain"),
          "the SRV name stops resolving")
    dnsmasq.stop()
    until(lambda: admin_get(gw.url, "/admin/discovery")["standard"]["last_error"].startswith("timeout"),
          "the nameserver stops answering")
    status = admin_get(gw.url, "/admin/discovery")["standard"]
    assert status["stale"] is True and status["replicas"] == 1 and status["source"] == f"dns:srv:{SRV_NAME}"
    listed = admin_get(gw.url, "/admin/fleet")
    assert list(listed) == [b] and listed[b]["state"] == "serving"
    assert asyncio.run(one_request(client(), 9999)).replica == b
    assert metric(gw.url, "yieldgate_discovery_failures_total", tier="standard", reason="nxdomain") >= 1
    assert metric(gw.url, "yieldgate_discovery_failures_total", tier="standard", reason="timeout") >= 1
    assert metric(gw.url, "yieldgate_discovery_stale", tier="standard") == 1
    warned = [r.getMessage() for r in caplog.records if "keeping the last good set (1 replicas)" in r.getMessage()]
    assert warned
