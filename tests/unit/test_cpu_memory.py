"""The CPU KV pool default (sgl_spec/cpu_memory.py): sized from the model, user flags win."""

from __future__ import annotations

import json

import pytest

from sgl_spec.cpu_memory import (
    DEFAULT_RUNNING_REQUESTS,
    FLOOR_CONTEXTS,
    kv_bytes_per_token,
    size_cpu_kv_pool,
)
from sgl_spec.launch_server import apply_cpu_defaults

GIB = 2**30
LLAMA = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "hidden_size": 512,
    "max_position_embeddings": 2048,
    "dtype": "float32",
}


def _model(tmp_path, name: str, **overrides) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
    return str(path)


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    # 2 (K, V) x 8 layers x 4 KV heads x 64 head dim x 4 bytes
    assert kv_bytes_per_token(LLAMA, 4) == 2 * 8 * 4 * 64 * 4
    assert kv_bytes_per_token({**LLAMA, "head_dim": 128}, 2) == 2 * 8 * 4 * 128 * 2
    assert kv_bytes_per_token({"hidden_size": 8}, 4) is None


def test_requests_times_context_when_ram_allows(tmp_path) -> None:
    target = _model(tmp_path, "t")
    sizing = size_cpu_kv_pool(["--model-path", target], 1024 * GIB)
    assert sizing.max_total_tokens == DEFAULT_RUNNING_REQUESTS * 2048
    assert "48 running requests x 2048 context tokens" in sizing.reason
    fewer = size_cpu_kv_pool(
        ["--model-path", target, "--max-running-requests", "2", "--context-length", "1024"],
        1024 * GIB,
    )
    assert fewer.max_total_tokens == FLOOR_CONTEXTS * 1024  # the floor: a few full contexts


def test_ram_caps_target_and_draft_together(tmp_path) -> None:
    target, draft = _model(tmp_path, "t"), _model(tmp_path, "d", num_hidden_layers=2)
    per_token = kv_bytes_per_token(LLAMA, 4) + kv_bytes_per_token(
        {**LLAMA, "num_hidden_layers": 2}, 4
    )
    ram = 4 * GIB
    sizing = size_cpu_kv_pool(
        ["--model-path", target, "--speculative-draft-model-path", draft], ram
    )
    assert sizing.max_total_tokens == int(0.08 * ram) // per_token
    assert sizing.max_total_tokens * per_token <= 0.08 * ram
    assert "capped at 8%" in sizing.reason


def test_half_precision_halves_the_bytes(tmp_path) -> None:
    target = _model(tmp_path, "t")
    fp32 = size_cpu_kv_pool(["--model-path", target], 2 * GIB)
    fp16 = size_cpu_kv_pool(["--model-path", target, "--dtype", "bfloat16"], 2 * GIB)
    assert fp16.max_total_tokens == pytest.approx(2 * fp32.max_total_tokens, abs=1)


def test_user_flags_and_unknown_models_keep_sglang_sizing(tmp_path) -> None:
    target = _model(tmp_path, "t")
    for flags in (["--max-total-tokens", "1000"], ["--mem-fraction-static=0.5"]):
        assert size_cpu_kv_pool(["--model-path", target, *flags], 64 * GIB) is None
    assert size_cpu_kv_pool(["--model-path", "org/hub-model"], 64 * GIB) is None
    assert (
        size_cpu_kv_pool(["--model-path", _model(tmp_path, "x", num_hidden_layers=None)], GIB)
        is None
    )


def test_cpu_defaults_add_the_pool_size_once(tmp_path) -> None:
    target = _model(tmp_path, "t")
    argv = apply_cpu_defaults(["--model-path", target], {})
    assert argv.count("--max-total-tokens") == 1
    user = apply_cpu_defaults(["--model-path", target, "--max-total-tokens", "777"], {})
    assert user[user.index("--max-total-tokens") + 1] == "777"
    assert user.count("--max-total-tokens") == 1
