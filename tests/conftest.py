from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer random target and a perturbed copy of it as draft (fp32, built once)."""
    from tests.helpers.tiny_models import build_llama, perturbed_copy

    root = tmp_path_factory.mktemp("tiny_models")
    target = build_llama(root / "target", seed=0, num_layers=2)
    draft = perturbed_copy(target, root / "draft", seed=1, noise=0.5)
    return {"target": target, "draft": draft}


@pytest.fixture(scope="session")
def tiny_specblock_drafter(tiny_models, tmp_path_factory) -> Path:
    """A SpecBlock drafter trained for the tiny target (``train_specblock_drafter``), built
    once: SPECBLOCK's and MINEDRAFT's serving tests both draft with it."""
    from tests.helpers.tiny_models import train_specblock_drafter

    return train_specblock_drafter(
        tiny_models["target"], tmp_path_factory.mktemp("specblock") / "drafter"
    )


@pytest.fixture(scope="session")
def baseline_greedy(tiny_models, tmp_path_factory) -> dict[str, list]:
    """Greedy token ids of the non-speculative server on the tiny target, computed once per
    session (short and long prompts; max 48 new tokens), then the server is stopped."""
    from tests.helpers.lossless import LONG_PROMPTS, PROMPTS
    from tests.helpers.server_utils import Server

    server = Server(
        ["--model-path", str(tiny_models["target"])],
        tmp_path_factory.mktemp("baseline") / "baseline.log",
    )
    try:
        outputs = {}
        for name, prompts in (("short", PROMPTS), ("long", LONG_PROMPTS)):
            out = server.generate(
                {"text": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
            )
            outputs[name] = [o["output_ids"] for o in out]
    finally:
        server.stop()
    return outputs


@pytest.fixture(scope="session")
def shipped_greedy(tmp_path_factory) -> dict[str, list]:
    """The non-speculative server's greedy ids on the shipped target for every request set of
    ``tests/helpers/shipped.py``, computed once per session, then the server is stopped."""
    from sgl_spec.models.registry import DEFAULT_TARGET
    from tests.helpers.server_utils import Server
    from tests.helpers.shipped import shipped_greedy_replies

    server = Server(
        ["--model-path", DEFAULT_TARGET],
        tmp_path_factory.mktemp("shipped_baseline") / "none.log",
    )
    try:
        return shipped_greedy_replies(server)
    finally:
        server.stop()


# Fixtures that start an SGLang server or a MINEDRAFT draft-server process: a test that uses
# one, directly or through another fixture, is in the `server` lane (`pytest -m "not server"`
# is the fast lane).
SERVER_FIXTURES = frozenset(
    {"servers", "baseline_greedy", "shipped_greedy", "default_server", "client"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
