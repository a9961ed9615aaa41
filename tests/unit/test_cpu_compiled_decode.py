"""SGLang's CPU graph runner compiles the shipped draft model's decode with our ops: the whole
forward, layers and LM head, traces as one graph with no break (every op has a fake that
matches its kernel, our rotary embedding's included; our patches' forward paths call nothing
dynamo cannot trace), each layer's K and V are separate allocations
(``patches/cpu_kv_split.py``), and the compiled logits equal the eager ones bit for bit at
batch 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sgl_spec.models.registry import DEFAULT_DRAFT, resolve_model_path
from tests.helpers.native_kernels import require_native

REPO = Path(__file__).resolve().parents[2]


def test_compiled_decode_of_the_shipped_draft(tmp_path: Path) -> None:
    require_native()
    out = tmp_path / "compiled.json"
    cmd = [sys.executable, str(REPO / "tests" / "helpers" / "compiled_decode_check.py"),
           resolve_model_path(DEFAULT_DRAFT), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kv_shared"] == [False] * result["layers"]
    assert result["graphs"] == 1
    assert result["attention_ops_in_first_graph"] == result["layers"]
    assert result["logits_equal"] is True
