"""``benchmarks/mtp_forward.py`` (``forward_cost.py --mtp-adapter``) times MTP_LORA's step
forward, not another: on the shipped target and adapter its anchors' logits are a chain
verify's of the same anchors (the tree mask hides the masks from them), the mask rows see
through the tree mask (a causal mask moves them), and the gate moves the mask rows' logits and
leaves the anchors' bit for bit."""

from __future__ import annotations

from pathlib import Path

from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path
from tests.helpers.model_check import run_check


def test_timed_step_is_the_gated_tree_verify(tmp_path: Path) -> None:
    result = run_check("mtp_forward_check.py", resolve_model_path(DEFAULT_TARGET), tmp_path)
    assert result["anchors_gate_free"] is True
    assert result["masks_gated"] is True
    assert result["masks_tree_masked"] is True
    assert result["anchors_as_chain"] < 1e-3
