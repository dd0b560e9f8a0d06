"""The engine's LoRA calls, one small async client: load, load in place, unload, list.

vLLM serves them with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (serving/launcher.py sets it when
the fleet's LoRA is on). A load makes the engine read and check the adapter directory itself, so
a missing or corrupt adapter is refused by the load, before any request uses it.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .fleet import only_families


class LoraEngineError(RuntimeError):
    """The engine refused a LoRA call (or could not be reached); `status` is its HTTP status (0 if
    it never answered), `message` its own words."""

    def __init__(self, url: str, call: str, status: int, message: str):
        super().__init__(f"{call} on {url}: HTTP {status}: {message}" if status else f"{call} on {url}: {message}")
        self.url, self.call, self.status, self.message = url, call, status, message


class LoraClient:
    """LoRA calls to any engine by base URL; one aiohttp session for all of them."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _post(self, url: str, path: str, body: dict) -> None:
        session = await self._http()
        try:
            async with session.post(url + path, json=body) as resp:
                if resp.status == 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise LoraEngineError(url, path, 0, f"{type(exc).__name__}: {exc}") from None
        raise LoraEngineError(url, path, resp.status, _message(text))

    async def load(self, url: str, name: str, path: str) -> None:
        """Register adapter `name` from the PEFT directory `path` (readable by the engine). A name
        the engine holds already is no error: another gateway loaded the same version first."""
        try:
            await self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except LoraEngineError as exc:
            if exc.status != 400 or "already been loaded" not in exc.message:
                raise

    async def load_inplace(self, url: str, name: str, path: str) -> None:
        """Replace the weights of the loaded adapter `name`. Requests running on it at that moment
        go on with the new weights: a response can then come from two versions."""
        await self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})

    async def unload(self, url: str, name: str) -> bool:
        """-> False if the engine did not have it (already gone is not an error here)."""
        try:
            await self._post(url, "/v1/unload_lora_adapter", {"lora_name": name})
        except LoraEngineError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def list(self, url: str) -> dict[str, str]:
        """The adapters the engine serves: name -> path (its /v1/models cards with a parent)."""
        session = await self._http()
        try:
            async with session.get(url + "/v1/models") as resp:
                if resp.status != 200:
                    raise LoraEngineError(url, "/v1/models", resp.status, _message(await resp.text()))
                cards = (await resp.json()).get("data", [])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise LoraEngineError(url, "/v1/models", 0, f"{type(exc).__name__}: {exc}") from None
        return {c["id"]: c.get("root") or "" for c in cards if isinstance(c, dict) and c.get("parent")}


    async def busy(self, url: str) -> set[str]:
        """The adapters the engine is running or has waiting now (`vllm:lora_requests_info`, whose
        newest label set is the engine's last step; empty when nothing runs there)."""
        session = await self._http()
        try:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise LoraEngineError(url, "/metrics", 0, f"{type(exc).__name__}: {exc}") from None
        return busy_adapters(text)


def busy_adapters(text: str) -> set[str]:
    """The adapters running or waiting in an engine's /metrics text: the newest label set of
    `vllm:lora_requests_info` (the value is when that set was last seen; the engine keeps one series
    for every set it ever ran, so only the newest line is parsed), none while nothing runs."""
    from prometheus_client.parser import text_string_to_metric_families

    info = [line for line in text.split("\n") if line.startswith("vllm:lora_requests_info{")]
    latest = max(info, key=lambda line: float(line.rsplit(" ", 1)[1]), default="")
    counts = only_families(text, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    newest, active = None, 0.0
    for family in text_string_to_metric_families(counts + latest + "\n"):
        for s in family.samples:
            if s.name == "vllm:lora_requests_info":
                newest = s
            elif s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                active += s.value
    if newest is None or not active:
        return set()
    names = newest.labels.get("running_lora_adapters", "") + "," + newest.labels.get("waiting_lora_adapters", "")
    return {n for n in names.split(",") if n}


def _message(text: str) -> str:
    """The engine's error message out of its OpenAI-shaped error body, else the raw text (cut)."""
    import json

    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else {}
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
    except ValueError:
        pass
    return text[:500]
