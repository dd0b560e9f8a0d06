"""Several models behind one gateway: the config's rules and how a request's `model` resolves to a
pool (gateway/registry.py), without engines. Routing through real engines: tests/test_many_models.py."""

from __future__ import annotations

import collections

import pytest

from yieldgate.gateway.config import ConfigError, load_config
from yieldgate.gateway.errors import ModelNotFound
from yieldgate.gateway.registry import ModelRegistry, open_pools

TWO_MODELS = """
[fleet]
model = "big"
[[fleet.replicas]]
name = "big-0"
url = "http://127.0.0.1:9001"
[[fleet.replicas]]
name = "big-fast-0"
tier = "fast"
url = "http://127.0.0.1:9002"

[[models]]
model = "small"
fallback_model = "big"
[[models.replicas]]
name = "small-0"
url = "http://127.0.0.1:9003"

[aliases]
prod = "big"
[aliases.ab]
targets = [{ model = "big", weight = 3 }, { model = "small", weight = 1 }]
[aliases.roll]
targets = [{ model = "big" }, { model = "small" }]
sticky = false
"""


def config(tmp_path, text: str = TWO_MODELS, name: str = "c.toml"):
    path = tmp_path / name
    path.write_text(text)
    return load_config(path, env={})


@pytest.fixture
def registry(tmp_path) -> ModelRegistry:
    cfg = config(tmp_path)
    return ModelRegistry(cfg, open_pools(cfg), seed=1)


def test_every_model_is_a_fleet_of_its_own(tmp_path):
    cfg = config(tmp_path)
    assert [f.model for f in cfg.fleets] == ["big", "small"]
    assert [r.name for r in cfg.models[0].replicas] == ["small-0"]
    assert cfg.aliases["prod"].targets[0].model == "big"  # the one-target shorthand


@pytest.mark.parametrize("extra, error", [
    ('[[models]]\nmodel = "big"\n[[models.replicas]]\nname = "x"\nurl = "http://127.0.0.1:1"\n',
     "model names must be unique"),
    ('[[models]]\nmodel = "other"\n[[models.replicas]]\nname = "big-0"\nurl = "http://127.0.0.1:1"\n',
     "replica names must be unique across models"),
    ('[[models]]\nmodel = "other"\nfallback_model = "nowhere"\n[[models.replicas]]\nname = "x"\nurl = "http://127.0.0.1:1"\n',
     "fallback_model must be another model"),
    ('[aliases]\nbig = "big"\n', "is already a model's name"),
    ('[aliases.none]\ntargets = []\n', "at least one target"),
])
def test_a_config_that_cannot_serve_is_refused(tmp_path, extra, error):
    base = '[fleet]\nmodel = "big"\n[[fleet.replicas]]\nname = "big-0"\nurl = "http://127.0.0.1:9001"\n'
    with pytest.raises(ConfigError, match=error):
        config(tmp_path, base + extra)


def test_names_resolve_to_their_pool(registry):
    assert registry.resolve("big").pool.name == "big"
    found = registry.resolve("small")
    assert (found.pool.name, found.model, found.requested) == ("small", "small", "")
    fast = registry.resolve("big:fast")
    assert (fast.pool.name, fast.model) == ("big", "big:fast")
    with pytest.raises(ModelNotFound, match="'nothing' does not exist"):
        registry.resolve("nothing")


def test_an_alias_names_its_target_and_keeps_the_fast_suffix(registry):
    found = registry.resolve("prod")
    assert (found.pool.name, found.model, found.requested) == ("big", "big", "prod")
    fast = registry.resolve("prod:fast")
    assert (fast.pool.name, fast.model, fast.requested) == ("big", "big:fast", "prod:fast")


def test_a_split_follows_its_weights_and_keeps_a_session_on_one_target(registry):
    unsticky = collections.Counter(registry.resolve("roll").pool.name for _ in range(2000))
    assert 850 < unsticky["big"] < 1150 and unsticky["big"] + unsticky["small"] == 2000
    by_session = collections.Counter(registry.resolve("ab", session=f"s{i}").pool.name for i in range(4000))
    assert 2800 < by_session["big"] < 3200  # 3:1 over sessions
    for i in range(50):  # ... and each session always the same one
        assert len({registry.resolve("ab", session=f"s{i}").pool.name for _ in range(5)}) == 1


def test_the_model_list_names_models_fast_tiers_and_aliases(registry):
    from yieldgate.gateway.registry import model_cards

    ids = [c.id for c in model_cards(registry)]
    assert ids == ["big", "big:fast", "small", "prod", "ab", "roll"]


def test_fallback_goes_to_the_other_model_only_while_nothing_of_its_own_can_serve(registry):
    small, big = registry.pool("small"), registry.pool("big")
    for replica in [*small.fleet.replicas.values(), *big.fleet.replicas.values()]:
        replica.healthy = True
    assert registry.fallback(small, "standard") is None
    small.fleet.replicas["small-0"].healthy = False
    assert registry.fallback(small, "standard") is big
    assert registry.fallback(big, "standard") is None  # big names no fallback model


def test_the_demo_config_serves_two_models_and_auto():
    from pathlib import Path

    cfg = load_config(Path(__file__).parent.parent / "examples" / "demo.toml", env={})
    assert [f.model for f in cfg.fleets] == ["smollm2", "tiny"] and cfg.auto.enabled
    assert [r.name for f in cfg.fleets for r in f.replicas] == ["standard-0", "fast-0", "tiny-0"]


def test_yieldgate_up_launches_each_model_with_its_own_weights_and_name(tmp_path, monkeypatch):
    import subprocess

    from yieldgate.serving import Launcher

    cfg = config(tmp_path, TWO_MODELS.replace('url = "http://127.0.0.1:9003"',
                                              'launch = { port = 9003, host = "127.0.3.1" }'))
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or object())
    launcher = Launcher(cfg.fleet, "/models/big", tmp_path, more=[(cfg.models[0], "/models/small")])
    launcher.start()  # big's replicas have URLs: only small's is launched
    (cmd,) = started
    assert cmd[cmd.index("--model") + 1] == "/models/small" and cmd[cmd.index("--served-model-name") + 1] == "small"
    assert cmd[cmd.index("--host") + 1] == "127.0.3.1"
