"""Replicas from the Kubernetes API: the EndpointSlices (or the pods) matching a label selector in
a namespace, listed once and then followed by a watch, as an informer does.

Through lightkube's AsyncClient (pyproject says why that client). The source keeps the objects the
watch reports; `resolve()` turns the current set into replicas: each ready endpoint address (or
each running, ready pod's IP) at the port named `port_name` (or `port`). Labels or annotations of
the slice or pod may carry the tier (`yieldgate.io/tier`: objects of another tier are skipped) and
the KV-event endpoint (`yieldgate.io/kv-events-port`). A watch that breaks is listed and watched
again (410 Gone included); until the first list succeeds, `resolve` raises DiscoveryError, so the
fleet keeps its last good set.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .config import DiscoveryConfig, ReplicaConfig
from .source import DiscoveryError, host_port

log = logging.getLogger("yieldgate.discovery")

TIER_KEY = "yieldgate.io/tier"
KV_EVENTS_PORT_KEY = "yieldgate.io/kv-events-port"
_RETRY_S = 1.0


class KubernetesSource:
    def __init__(self, tier: str, config: DiscoveryConfig):
        self.tier, self.config = tier, config
        self.resource = config.resource
        self.label = f"kubernetes:{config.namespace}/{config.resource}?{config.label_selector}"
        self.objects: dict[str, Any] = {}     # name -> the EndpointSlice or Pod as last reported
        self.synced = asyncio.Event()        # the first list is in
        self.last_error = ""
        self.relists = 0
        self._task: asyncio.Task | None = None
        self._client: Any = None

    async def resolve(self) -> list[ReplicaConfig]:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"kubernetes-watch-{self.tier}")
        try:
            await asyncio.wait_for(self.synced.wait(), self.config.timeout_s)
        except TimeoutError:
            raise DiscoveryError("timeout", f"{self.label}: no list yet ({self.last_error or 'waiting'})") from None
        replicas = sorted(self._replicas(), key=lambda r: r.name)
        if not replicas:
            raise DiscoveryError("empty", f"{self.label} lists no ready replica")
        return replicas

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._client is not None:
            await self._client._client.close()
            self._client = None

    # -- following the API ---------------------------------------------------------------------

    def _make_client(self) -> Any:
        from lightkube import AsyncClient, KubeConfig
        from lightkube.config.models import Cluster, User

        if self.config.api_server:  # a plain URL (kubectl proxy, or recorded traffic in the tests)
            config = KubeConfig.from_one(cluster=Cluster(server=self.config.api_server), user=User(),
                                         namespace=self.config.namespace)
        else:  # in-cluster service account, else $KUBECONFIG or ~/.kube/config
            config = KubeConfig.from_env()
        return AsyncClient(config, namespace=self.config.namespace, trust_env=False)

    def _kind(self) -> Any:
        if self.resource == "pods":
            from lightkube.resources.core_v1 import Pod
            return Pod
        from lightkube.resources.discovery_v1 import EndpointSlice
        return EndpointSlice

    async def _follow(self) -> None:
        kind = self._kind()
        selector = _selector(self.config.label_selector)
        while True:
            try:
                if self._client is None:
                    self._client = self._make_client()
                listing = self._client.list(kind, namespace=self.config.namespace, labels=selector)
                found = {obj.metadata.name: obj async for obj in listing}
                self.objects = found
                self.relists += 1
                self.synced.set()
                version = listing.resourceVersion
                async for event, obj in self._client.watch(kind, namespace=self.config.namespace, labels=selector,
                                                           resource_version=version):
                    if event == "DELETED":
                        self.objects.pop(obj.metadata.name, None)
                    else:  # ADDED, MODIFIED
                        self.objects[obj.metadata.name] = obj
                self.last_error = "watch ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # 410 Gone, a dropped connection, an unreachable API server
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("kubernetes discovery for tier %s (%s): %s; listing again", self.tier, self.label,
                            self.last_error)
            await asyncio.sleep(_RETRY_S)

    # -- objects -> replicas ---------------------------------------------------------------------

    def _replicas(self) -> list[ReplicaConfig]:
        out: dict[str, ReplicaConfig] = {}
        for obj in list(self.objects.values()):
            meta = obj.metadata
            marks = {**(meta.labels or {}), **(meta.annotations or {})}
            if marks.get(TIER_KEY, self.tier) != self.tier:
                continue
            kv = int(marks.get(KV_EVENTS_PORT_KEY) or self.config.kv_events_port or 0)
            for address, port in (self._pod(obj) if self.resource == "pods" else self._slice(obj)):
                where = host_port(address, port)
                out[where] = ReplicaConfig(name=where, tier=self.tier, url=f"http://{where}",
                                           cost_per_hour=self.config.cost_per_hour,
                                           kv_events_endpoint=f"tcp://{host_port(address, kv)}" if kv else "")
        return list(out.values())

    def _slice(self, s: Any) -> list[tuple[str, int]]:
        port = self._port([(p.name, p.port) for p in (s.ports or [])])
        if port is None:
            return []
        found = []
        for endpoint in s.endpoints or []:
            conditions = endpoint.conditions
            # ready unset means ready (the API's own rule); a terminating endpoint takes no new work
            if conditions is not None and (conditions.ready is False or conditions.terminating):
                continue
            found += [(a, port) for a in endpoint.addresses]
        return found

    def _pod(self, pod: Any) -> list[tuple[str, int]]:
        status = pod.status
        if status is None or status.phase != "Running" or not status.podIP or pod.metadata.deletionTimestamp:
            return []
        if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or []):
            return []
        ports = [(p.name, p.containerPort) for c in pod.spec.containers for p in (c.ports or [])]
        port = self._port(ports)
        return [] if port is None else [(status.podIP, port)]

    def _port(self, ports: list[tuple[str | None, int | None]]) -> int | None:
        if self.config.port_name:
            return next((p for name, p in ports if name == self.config.port_name and p), None)
        return self.config.port or None


def _selector(text: str) -> dict[str, str]:
    """"app=vllm,tier=standard" -> {"app": "vllm", "tier": "standard"} (equality selectors)."""
    pairs = [part.strip() for part in text.split(",") if part.strip()]
    return dict(p.split("=", 1) for p in pairs)
