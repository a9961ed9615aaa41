"""SGLang's CPU graph runner compiles the shipped draft model's decode with our ops: the whole
forward, layers and LM head, traces as one graph with no break (every op has a fake that
matches its kernel, our rotary embedding's included; our patches' forward paths call nothing
dynamo cannot trace), each layer's K and V are separate allocations
(``patches/cpu_kv_split.py``), and the compiled logits equal the eager ones bit for bit at
batch 2."""

from __future__ import annotations

from pathlib import Path

from sgl_spec.models.registry import DEFAULT_DRAFT, resolve_model_path
from tests.helpers.model_check import run_check
from tests.helpers.native_kernels import require_native


def test_compiled_decode_of_the_shipped_draft(tmp_path: Path) -> None:
    require_native()
    result = run_check("compiled_decode_check.py", resolve_model_path(DEFAULT_DRAFT), tmp_path)
    assert result["kv_shared"] == [False] * result["layers"]
    assert result["graphs"] == 1
    assert result["attention_ops_in_first_graph"] == result["layers"]
    assert result["logits_equal"] is True
