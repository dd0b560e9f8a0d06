"""`WeightHistory`: what a rollback returns to, in pure Python (no engine). The engine story is in
test_weights_rollback.py."""

from __future__ import annotations

import pytest
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


def test_history_is_bounded_but_keeps_the_rollback_target_and_marks(tmp_path):
    h = WeightHistory(tmp_path / "history.json", keep_stints=4)
    serve(h, "default")
    serve(h, "good")
    for i in range(6):  # six bad versions in a row, each rolled back to "good"
        serve(h, f"bad-{i}")
        rollback(h)
    assert {h.serving(r) for r in (R1, R2)} == {"good"}
    serve(h, "next")
    for r in (R1, R2):
        stints = [s for s in h._rec.stints if s.replica == r]
        assert len(stints) <= 4
    # "good" is still the way back, though its first stint is older than the window...
    assert h.rollback_target(R1) == "good"
    # ...and every bad version named by a stint still kept stays skipped.
    kept = {s.version for s in h._rec.stints}
    assert {v for v in kept if v.startswith("bad-")} and all(h.marked(v) for v in kept if v.startswith("bad-"))
    # "next" rolled back: back on "good", whose own way back ("default", older than the
    # window) was kept too.
    rollback(h)
    assert h.serving(R1) == "good" and h.rollback_target(R1) == "default"
    assert len([s for s in h._rec.stints if s.replica == R1]) <= 4
    # The bounded record is what is on disk.
    assert len(WeightHistory(tmp_path / "history.json")._rec.stints) == len(h._rec.stints)


def test_the_window_never_drops_the_stint_a_rollback_returns_to(tmp_path):
    """The target's stint is older than every stint kept: trimming must skip over it, also when
    the version left is marked only after the restore is recorded (a failed rollout)."""
    h = WeightHistory(tmp_path / "history.json", keep_stints=3)
    serve(h, "old", R1)
    serve(h, "good", R1)
    for i in range(10):
        serve(h, f"bad-{i}", R1)
        h.observe(R1, "good", "failed")  # restored, then marked
        h.mark(f"bad-{i}", "failed", "canary")
        assert h.rollback_target(R1) == "old"
    assert len([s for s in h._rec.stints if s.replica == R1]) == 3


def test_marks_of_versions_never_served_are_bounded(tmp_path):
    h = WeightHistory(tmp_path / "history.json", keep_stints=3)
    serve(h, "default")
    for i in range(8):
        h.mark(f"refused-{i}", "failed", "staging failed")
    assert sorted(h._rec.marks) == ["refused-5", "refused-6", "refused-7"]


def test_library_rollout_rollback_follows_the_history(tmp_path):
    """`Rollout.rollback()` without the gateway: per replica, what it served before, skipping
    marked versions (not the store's second-newest version)."""
    from yieldgate.trainer_bridge import RolloutFailed
    from yieldgate.trainer_bridge.rollout import EngineFleet, Rollout

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    store = CheckpointStore(tmp_path / "versions", base, keep=10)
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    rollout = Rollout(EngineFleet(urls), store)
    for v in ("A", "B", "C"):
        store.save(v, {"w": torch.zeros(2)})
    h = store.history
    for u in urls:
        h.observe(u, "default")
        h.observe(u, "A")
    h.observe(urls[0], "B")
    h.observe(urls[0], "A", "failed")  # B's rollout failed on the first replica, restored to A
    h.mark("B", "failed", "canary")
    for u in urls:
        h.observe(u, "C")
    # The store's second-newest is B; the history says A (B failed) for both.
    assert store.versions()[-2] == "B"
    assert rollout.rollback_targets(urls) == {urls[0]: "A", urls[1]: "A"}
    h.mark("A", "rolled_back", "test")
    assert rollout.rollback_targets(urls) == {urls[0]: "default", urls[1]: "default"}
    assert rollout.rollback_targets(urls, "B") == {u: "B" for u in urls}  # named on purpose
    with pytest.raises(RolloutFailed):
        rollout.rollback_targets(urls, "Z")
    h.mark("default", "rolled_back", "test")
    with pytest.raises(RolloutFailed, match="nothing to roll back to"):
        rollout.rollback_targets(urls)
