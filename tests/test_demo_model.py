from yieldgate.serving.demo_model import DemoModelSpec, ensure_demo_model, files_digest, make_demo_model


def test_same_seed_gives_byte_identical_files(tmp_path):
    cached = ensure_demo_model()
    fresh = make_demo_model(tmp_path / "again")
    assert files_digest(fresh) == files_digest(cached)
    names = {p.name for p in fresh.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_other_seed_gives_other_weights(tmp_path):
    other = make_demo_model(tmp_path / "s1", DemoModelSpec(seed=1))
    base = ensure_demo_model()
    assert (other / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()


def test_fleet_config_names_a_bigger_generated_model(tmp_path):
    """examples/routing-fleet-kv192.toml serves a generated 28 MB model: its shape lives in the config."""
    import json
    from pathlib import Path

    import pytest

    from yieldgate.gateway.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[1]
    spec = load_config(root / "examples" / "routing-fleet-kv192.toml", env={}).fleet.demo_model
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads) == (384, 1024, 4, 6)
    assert spec.key != DemoModelSpec().key
    made = make_demo_model(tmp_path / "big", spec)
    config = json.loads((made / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (384, 4, 6)

    typo = tmp_path / "typo.toml"
    typo.write_text("[fleet.demo_model]\nhiden_size = 384\n")
    with pytest.raises(ConfigError, match="hiden_size"):
        load_config(typo, env={})
