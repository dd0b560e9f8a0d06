"""The `kubernetes` replica source against recorded API traffic. No Kubernetes API server can run
on these machines, and none runs in CI: a small HTTP server on a loopback address of its own
answers the list and watch requests lightkube sends, with EndpointSliceList/PodList bodies and
watch event lines shaped like the real API's (tests/data/kubernetes/*.json), including a
410 Expired error event that makes the source list again.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from aiohttp import web

from yieldgate.gateway.config import ConfigError, load_config
from yieldgate.serving.config import DiscoveryConfig
from yieldgate.serving.discovery import DiscoveryError, KubernetesSource, sources_for

DATA = Path(__file__).parent / "data" / "kubernetes"
API_ADDRESS = "127.0.4.2"
PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 420


class RecordedApi:
    """Replays a recording: `list` (then `relist` after an error event), and each watch request
    streams the next recorded batch of events; events go out only when the test releases them."""

    def __init__(self, recording: dict, path: str):
        self.recording, self.path = recording, path
        self.requests: list[dict[str, str]] = []
        self.lists = 0
        self.events: asyncio.Queue = asyncio.Queue()
        self.runner: web.AppRunner | None = None
        self.watching = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.query))
        if request.query.get("watch") not in ("true", "1"):
            self.lists += 1
            body = self.recording["list" if self.lists == 1 else "relist"]
            return web.json_response(body)
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        self.watching += 1
        try:
            while True:
                event = await self.events.get()
                if event is None:  # stop()
                    return resp
                await resp.write(json.dumps(event).encode() + b"\n")
                if event["type"] == "ERROR":  # the API server ends the watch after an error event
                    return resp
        finally:
            self.watching -= 1

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(self.path, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, API_ADDRESS, PORT).start()
        return f"http://{API_ADDRESS}:{PORT}"

    async def stop(self) -> None:
        for _ in range(self.watching):
            self.events.put_nowait(None)
        if self.runner is not None:
            await self.runner.cleanup()


def recording(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def k8s(api_server: str, **kw) -> DiscoveryConfig:
    return DiscoveryConfig(kind="kubernetes", namespace="serving", label_selector="app=vllm",
                           api_server=api_server, timeout_s=5, **kw)


async def until(source: KubernetesSource, want, attempts: int = 200):
    got = None
    for _ in range(attempts):
        try:
            got = [(r.name, r.kv_events_endpoint) for r in await source.resolve()]
        except DiscoveryError as exc:
            got = exc.reason
        if got == want:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"resolve() gave {got}, never {want}")


def test_endpointslices_listed_then_watched_and_listed_again_after_410():
    rec = recording("endpointslices.json")

    async def run():
        api = RecordedApi(rec, "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices")
        url = await api.start()
        source = KubernetesSource("standard", k8s(url, port_name="http"))
        try:
            # Listed: ready endpoints only (not-ready and terminating ones take no requests).
            assert await until(source, [("127.0.2.1:8000", "tcp://127.0.2.1:5557"),
                                        ("127.0.2.2:8000", "tcp://127.0.2.2:5557")])
            # Watched from the list's resourceVersion: an endpoint turns ready; another tier's slice is skipped.
            for event in rec["watch"][:2]:
                api.events.put_nowait(event)
            await until(source, [("127.0.2.1:8000", "tcp://127.0.2.1:5557"), ("127.0.2.2:8000", "tcp://127.0.2.2:5557"),
                                 ("127.0.2.3:8000", "tcp://127.0.2.3:5557")])
            # 410 Expired: the source lists again and watches from the new version.
            api.events.put_nowait(rec["watch"][2])
            await until(source, [("127.0.2.2:8000", "tcp://127.0.2.2:5557"), ("127.0.2.3:8000", "tcp://127.0.2.3:5557")])
            assert source.relists == 2 and "too old resource version" in source.last_error
            # The slice is deleted: no replica is an error, so the fleet keeps its last good set.
            api.events.put_nowait(rec["rewatch"][0])
            await until(source, "empty")
            return api.requests
        finally:
            await source.close()
            await api.stop()

    requests = asyncio.run(run())
    lists = [q for q in requests if "watch" not in q]
    watches = [q for q in requests if "watch" in q]
    assert [q["labelSelector"] for q in requests] == ["app=vllm"] * len(requests)
    assert [q.get("resourceVersion") for q in watches[:2]] == ["1002", "1041"]
    assert len(lists) == 2


def test_pods_by_label_selector_running_and_ready_at_the_named_port():
    rec = recording("pods.json")

    async def run():
        api = RecordedApi(rec, "/api/v1/namespaces/serving/pods")
        url = await api.start()
        source = KubernetesSource("standard", k8s(url, port_name="http", resource="pods"))
        try:
            # vllm-1 not ready, vllm-2 pending, vllm-3 of the fast tier.
            await until(source, [("127.0.2.1:8000", "tcp://127.0.2.1:5557")])
            api.events.put_nowait(rec["watch"][0])  # vllm-1 turns ready
            await until(source, [("127.0.2.1:8000", "tcp://127.0.2.1:5557"), ("127.0.2.2:8000", "tcp://127.0.2.2:5557")])
            api.events.put_nowait(rec["watch"][1])  # vllm-0 is being deleted
            await until(source, [("127.0.2.2:8000", "tcp://127.0.2.2:5557")])
        finally:
            await source.close()
            await api.stop()

    asyncio.run(run())


def test_an_unreachable_api_server_is_a_failed_lookup():
    async def run():
        source = KubernetesSource("standard", DiscoveryConfig(
            kind="kubernetes", namespace="serving", label_selector="app=vllm", port=8000, timeout_s=0.5,
            api_server=f"http://{API_ADDRESS}:{PORT + 1}"))
        try:
            with pytest.raises(DiscoveryError) as err:
                await source.resolve()
            assert err.value.reason == "timeout" and "ConnectError" in str(err.value)
        finally:
            await source.close()

    asyncio.run(run())


def test_kubernetes_settings_are_checked_at_load(tmp_path):
    path = tmp_path / "yieldgate.toml"
    bad = {
        'kind = "kubernetes"\nlabel_selector = "app=vllm"\nport = 8000': "needs a namespace and a label_selector",
        'kind = "kubernetes"\nnamespace = "serving"\nlabel_selector = "app=vllm"': "needs a port_name or a port",
        'kind = "kubernetes"\nnamespace = "s"\nlabel_selector = "app!=vllm"\nport = 1': "only key=value selectors",
        'kind = "kubernetes"\nnamespace = "s"\nlabel_selector = "a=b"\nport = 1\nresource = "services"': "resource must be",
    }
    for body, message in bad.items():
        path.write_text(f"[fleet.tiers.standard.discovery]\n{body}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path, env={})
    # The keys the Helm chart writes.
    path.write_text('[fleet.tiers.standard.discovery]\nkind = "kubernetes"\nnamespace = "serving"\n'
                    'label_selector = "app=vllm,yieldgate.io/tier=standard"\nport_name = "http"\n')
    fleet = load_config(path, env={}).fleet
    [source] = sources_for(fleet)
    assert isinstance(source, KubernetesSource) and source.label == \
        "kubernetes:serving/endpointslices?app=vllm,yieldgate.io/tier=standard"
