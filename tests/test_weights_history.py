"""`WeightHistory`: what a rollback returns to, in pure Python (no engine). The engine story is in
test_weights_rollback_history.py."""

from __future__ import annotations

import torch

from yieldgate.trainer_bridge import CheckpointStore, WeightHistory

R1, R2 = "standard-0", "fast-0"


def serve(h: WeightHistory, version: str, *replicas: str, ending: str = "superseded") -> None:
    for r in replicas or (R1, R2):
        h.observe(r, version, ending)


def rollback(h: WeightHistory, *replicas: str) -> None:
    """What the gateway does: mark what is left, then each replica serves its target."""
    replicas = replicas or (R1, R2)
    targets = {r: h.rollback_target(r) for r in replicas}
    for r in replicas:
        h.mark(h.serving(r), "rolled_back", "test")
    for r, t in targets.items():
        h.observe(r, t, "rolled_back")


def test_rollback_never_returns_to_a_rolled_back_or_failed_version(tmp_path):
    h = WeightHistory(tmp_path / "history.json")
    serve(h, "default")
    assert h.rollback_target(R1) is None
    serve(h, "A")
    rollback(h)
    assert {h.serving(r) for r in (R1, R2)} == {"default"}
    assert h.rollback_target(R1) is None  # A was rolled back: nothing left to go back to
    serve(h, "B")
    assert h.rollback_target(R1) == "default"  # the bug: not A
    rollback(h)
    serve(h, "C")
    serve(h, "D")
    # E reached R1, then its rollout failed and R1 was restored to D.
    serve(h, "E", R1)
    h.observe(R1, "D", "failed")
    h.mark("E", "failed", "checksum mismatch on fast-0")
    assert {r: h.rollback_target(r) for r in (R1, R2)} == {R1: "C", R2: "C"}
    assert h.pinned() == {"C", "D"}

    # The record is on disk: a new object over the same file answers the same.
    again = WeightHistory(tmp_path / "history.json")
    assert {r: again.rollback_target(r) for r in (R1, R2)} == {R1: "C", R2: "C"}
    assert again.marked("E").reason == "checksum mismatch on fast-0"
    e = next(v for v in again.describe() if v["version"] == "E")
    assert e["mark"]["mark"] == "failed" and e["served"][0]["ended"] == "failed"
    assert e["served"][0]["reason"] == "checksum mismatch on fast-0"
    a = next(v for v in again.describe() if v["version"] == "A")
    assert a["mark"]["mark"] == "rolled_back" and a["served"][0]["ended"] == "rolled_back"


def test_rolling_update_cut_short_rolls_each_replica_back_to_its_own_version(tmp_path):
    h = WeightHistory(tmp_path / "history.json")
    serve(h, "default")
    serve(h, "A")
    serve(h, "B", R1)  # R2 never got B
    assert {r: h.rollback_target(r) for r in (R1, R2)} == {R1: "A", R2: "default"}


def test_unavailable_versions_are_skipped(tmp_path):
    h = WeightHistory(tmp_path / "history.json")
    for v in ("default", "A", "B"):
        serve(h, v)
    assert h.rollback_target(R1, available=lambda v: v != "A") == "default"


def test_store_never_evicts_the_rollback_target(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    store = CheckpointStore(tmp_path / "versions", base, keep=2)
    sd = {"w": torch.zeros(2)}
    h = store.history
    serve(h, "default")
    for v in ("C", "X", "Y"):
        store.save(v, sd, protect={h.serving(R1)})
        serve(h, v)
        if v == "X":
            rollback(h)  # back to C; X is marked
    # Serving Y, a rollback returns to C (X was rolled back): C stays, the marked X goes first.
    assert store.rollback_target(R1) == "C"
    assert store.versions() == ["C", "Y"]
