"""The push token the engines are armed with, and which engines run the `yieldgate` backend.

The token is kept on disk (0600) so a restarted gateway still holds it: an engine armed with a
lost token refuses every later push. An engine that restarts holds no token; it is probed and
armed again at the next push.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from yieldgate.serving import EngineControl, Replica
from .errors import RolloutFailed
from .rollout import rotate_push_token

log = logging.getLogger("yieldgate.weights")


class EngineArming:
    def __init__(self, root: Path) -> None:
        """`root`: where the token file lives."""
        self.root = root
        self._token: str | None = None
        self._armed: dict[str, bool] = {}  # engine URL -> runs our backend, armed with `token`

    @property
    def token(self) -> str:
        """The token engines are armed with (made and saved at first use)."""
        if self._token is None:
            path = self.root / "engine_push_token"
            if path.exists():
                self._token = path.read_text().strip()
            else:
                self.root.mkdir(parents=True, exist_ok=True)
                self._token = secrets.token_urlsafe(24)
                path.touch(mode=0o600)
                path.write_text(self._token)
        return self._token

    def remember(self, token: str | None) -> None:
        """The engines now hold `token` (a rollout rotated them to it)."""
        if token and token != self._token:
            self._token = token
            (self.root / "engine_push_token").write_text(token)

    def forget(self, url: str) -> None:
        """The engine at `url` holds no token any more (a restart, a refused push)."""
        self._armed.pop(url, None)

    async def ensure_armed(self, replicas: list[Replica]) -> None:
        """Arm unarmed engines with the token (re-arming with the same token is a no-op)."""
        for r in replicas:
            async with EngineControl(r.url, 60.0) as engine:
                if await engine.transfer_backend() != "yieldgate":
                    self._armed[r.url] = False
                    continue
                await engine.arm(self.token)
            self._armed[r.url] = True

    async def all_armed(self, replicas: list[Replica]) -> bool:
        """Do all `replicas` run the yieldgate backend, armed with the token? Probed (and armed)
        once per engine URL; an engine that refuses a push is probed again next time."""
        unknown = [r.url for r in replicas if r.url not in self._armed]
        if unknown:
            try:
                found = await rotate_push_token(unknown, self.token, self.token)
            except RolloutFailed as exc:
                log.warning("engines not armed (%s); pushes are relayed by the gateway", exc)
                return False
            self._armed.update({url: b == "yieldgate" for url, b in found.items()})
        return all(self._armed[r.url] for r in replicas)

    async def retire(self, replicas: list[Replica]) -> None:
        """Rotate the engines off the token a trainer was handed (its push is over)."""
        token = secrets.token_urlsafe(24)
        try:
            await rotate_push_token([r.url for r in replicas], token, self.token)
        except RolloutFailed as exc:  # every engine was handed back the old token
            log.warning("push token not retired: %s", exc)
            return
        self.remember(token)
