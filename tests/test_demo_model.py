from serving.demo_model import DemoModelSpec, ensure_demo_model, files_digest, make_demo_model


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
