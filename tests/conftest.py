from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer random target and a perturbed copy of it as draft (fp32, built once)."""
    from tiny_models import build_llama, perturbed_copy

    root = tmp_path_factory.mktemp("tiny_models")
    target = build_llama(root / "target", seed=0, num_layers=2)
    draft = perturbed_copy(target, root / "draft", seed=1, noise=0.5)
    return {"target": target, "draft": draft}
