"""The models `yieldgate up` serves by name, and the directories they come from.

`smollm2` (the default) is SmolLM2-135M-Instruct from the package index: a real instruct model that
answers, so outputs can be graded. `tiny` is the generated random-weight Llama: gibberish, but it
starts in seconds, which is what most tests want. Anything else is a Hugging Face model directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .demo_model import DemoModelSpec, ensure_demo_model
from .smollm2 import ensure_smollm2

DEFAULT_MODEL = "smollm2"
BUILTIN_MODELS = ("smollm2", "tiny")


def served_name(model_path: str) -> str:
    """The name clients send when the config names none: a built-in's own name, else the directory's."""
    source = model_path or DEFAULT_MODEL
    return source if source in BUILTIN_MODELS else (Path(source).name or "model")


def ensure_model(model_path: str, spec: DemoModelSpec = DemoModelSpec(),
                 progress: Callable[[str], None] | None = None) -> Path:
    """The directory of `model_path` ("" = the default built-in), made first if it is a built-in."""
    source = model_path or DEFAULT_MODEL
    if source == "smollm2":
        return ensure_smollm2(progress=progress)
    if source == "tiny":
        return ensure_demo_model(spec=spec)
    path = Path(source)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{source}: not a model directory (no config.json) and not one of "
                                f"{', '.join(BUILTIN_MODELS)}")
    return path
