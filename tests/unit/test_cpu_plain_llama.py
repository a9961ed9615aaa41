"""``patches/cpu_plain_llama.py``: the shipped Llama served through the plain layer stack gives
upstream's hidden states and captured features bit for bit (a prefill, a decode, a verify
chain; features at two layers' inputs), and the patch serves it; what it does not serve takes
upstream's forward."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path
from sgl_spec.patches import cpu_plain_llama
from tests.helpers.model_check import run_check


def test_plain_stack_equals_upstream_on_the_shipped_target(tmp_path: Path) -> None:
    result = run_check(
        "plain_llama_check.py", resolve_model_path(DEFAULT_TARGET), tmp_path, timeout=300
    )
    assert result["serves"] is True
    assert set(result["cases"]) == {"prefill", "decode", "verify"}
    for name, case in result["cases"].items():
        assert case["hidden_equal"], name
        assert case["captures"] == [2, 2], name
        assert case["captures_equal"], name


@pytest.mark.parametrize(
    ("input_embeds", "proxies", "idle", "before_norm"),
    [("embeds", None, False, False), (None, "proxies", False, False),
     (None, None, True, False), (None, None, False, True)],
)  # fmt: skip
def test_other_calls_take_upstream(input_embeds, proxies, idle, before_norm) -> None:
    model = SimpleNamespace(_sgl_spec_plain=True)  # the cached per-model decision
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: idle),
        return_hidden_states_before_norm=before_norm,
    )
    ids = SimpleNamespace(numel=lambda: 3)
    assert not cpu_plain_llama._serves(model, ids, batch, input_embeds, proxies)
    plain = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False))
    assert cpu_plain_llama._serves(model, ids, plain, None, None)
