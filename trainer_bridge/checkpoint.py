"""Versions kept on disk as Hugging Face checkpoint directories.

Two jobs: the fallback path for engines without the yieldgate plugin (vLLM reloads a directory
through `/collective_rpc reload_weights`), and rollback — every version a rollout pushes is saved
first, so going back to N-1 is one reload.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from .history import WeightHistory

# Files copied from the base model so a saved version is a complete, loadable HF directory.
_SIDECAR_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_VERSION_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def write_checkpoint(
    state_dict: Mapping[str, torch.Tensor], base_model_dir: str | Path, out_dir: str | Path
) -> Path:
    """Write `out_dir` (config + tokenizer from `base_model_dir`, weights from `state_dict`)
    atomically: built beside the target, then renamed, so a reader never sees half a model."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        for name in _SIDECAR_FILES:
            src = Path(base_model_dir) / name
            if src.exists():
                shutil.copy2(src, tmp / name)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class CheckpointStore:
    """`root/<version>/` directories plus `root/versions.json` (oldest first) and
    `root/history.json` (what was served, and which versions a rollback must skip)."""

    def __init__(self, root: str | Path, base_model_dir: str | Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.base_model_dir = Path(base_model_dir)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.history = WeightHistory(self.root / "history.json",
                                     available=lambda v: self.source(v) is not None)

    @property
    def _index(self) -> Path:
        return self.root / "versions.json"

    def versions(self) -> list[str]:
        if not self._index.exists():
            return []
        return list(json.loads(self._index.read_text()))

    def path(self, version: str) -> Path:
        if not _VERSION_RE.match(version):
            raise ValueError(f"bad version name {version!r}")
        return self.root / version

    def has(self, version: str) -> bool:
        return version in self.versions() and (self.path(version) / "model.safetensors").exists()

    def save(self, version: str, state_dict: Mapping[str, torch.Tensor],
             protect: Collection[str] = ()) -> Path:
        """`protect`: versions not to evict for room, e.g. the ones still served while `version`
        rolls out (a failure restores them from here)."""
        path = write_checkpoint(state_dict, self.base_model_dir, self.path(version))
        self._record(version, protect)
        return path

    def adopt(self, version: str, model_dir: str | Path) -> Path:
        """Register an existing HF directory (e.g. the base model) as `version`, by copy."""
        target = self.path(version)
        if not target.exists():
            shutil.copytree(model_dir, target)
        self._record(version)
        return target

    def discard(self, version: str) -> None:
        """Forget a version (a rejected rollout must not become the rollback target)."""
        shutil.rmtree(self.path(version), ignore_errors=True)
        self._write_index([v for v in self.versions() if v != version])

    def previous(self, version: str) -> str | None:
        versions = self.versions()
        if version not in versions:
            return versions[-1] if versions else None
        i = versions.index(version)
        return versions[i - 1] if i > 0 else None

    def source(self, version: str) -> Path | None:
        """The directory that holds `version`'s weights, or None if nothing does. The launch
        weights ("default") never leave disk: once evicted from the store, they are read from
        the base model."""
        if self.has(version):
            return self.path(version)
        return self.base_model_dir if version == "default" else None

    def rollback_target(self, replica: str) -> str | None:
        """What a rollback of `replica` returns to (see `WeightHistory.rollback_target`)."""
        return self.history.rollback_target(replica)

    def _record(self, version: str, protect: Collection[str] = ()) -> None:
        """Add `version` as the newest, then evict beyond `keep`: marked versions first, then the
        oldest; never one `protect`ed, served, or that a rollback would return to."""
        versions = [v for v in self.versions() if v != version] + [version]
        excess = len(versions) - self.keep if self.keep > 0 else 0
        pinned = set(protect) | self.history.pinned(lambda v: v in versions or v == "default")
        candidates = sorted((v for v in versions[:-1] if v not in pinned),
                            key=lambda v: self.history.marked(v) is None)  # stable: oldest first
        evict = candidates[: max(excess, 0)]
        for old in evict:
            shutil.rmtree(self.path(old), ignore_errors=True)
        self._write_index([v for v in versions if v not in evict])

    def _write_index(self, versions: list[str]) -> None:
        tmp = self._index.with_suffix(".tmp")
        tmp.write_text(json.dumps(versions))
        tmp.replace(self._index)
