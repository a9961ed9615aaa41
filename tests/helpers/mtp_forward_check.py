"""Run by ``tests/unit/test_mtp_forward_bench.py`` in its own process: the MTP_LORA step that
``benchmarks/mtp_forward.py`` times is the step's forward, on the shipped target and adapter:
its anchors see the prefix and the earlier anchors only (their logits are a chain verify's of
the same anchors), its mask rows see through the layout's tree mask (not a causal one), and
they, and only they, take the gated LoRA path.

    python tests/helpers/mtp_forward_check.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import forward_cost  # noqa: E402
import mtp_forward  # noqa: E402

CTX, K = 24, 2


def main(model: str, out_path: str) -> None:
    args = forward_cost.parse_args(["--batch-sizes", "2", "--num-tokens", "1", "--ctx-len", "24"])
    runner = forward_cost._load_runner(model, args)
    import torch
    from gamma_tolerance import build_extend

    from sgl_spec.models.registry import DEFAULT_MTP_ADAPTER, resolve_model_path
    from sgl_spec.mtp.adapter_io import load_adapter
    from sgl_spec.mtp.sglang_lora import install_gated_lora

    adapter = resolve_model_path(DEFAULT_MTP_ADAPTER)
    hf_config = runner.model_config.hf_config
    mask_ids = list(load_adapter(adapter, hf_config)[1].mask_token_ids)
    lora = install_gated_lora(runner.model, adapter, hf_config, dtype=runner.dtype,
                              device=torch.device(runner.device))  # fmt: skip
    reqs = forward_cost.prefilled(runner, 2, CTX, (K + 1) ** 2, random.Random(0))
    width = (K + 1) ** 2

    def logits(kind: str) -> torch.Tensor:
        n = K + 1 if kind == "chain" else width
        batch, _ = build_extend(runner, reqs, CTX, CTX + n)
        with torch.no_grad():
            if kind == "chain":
                out = runner.forward(forward_cost._verify_batch(runner, batch, n))
            else:
                fb, lay = mtp_forward._mtp_verify_batch(runner, batch, K, mask_ids)
                if kind == "causal":  # the same step under a chain's causal mask instead
                    fb.spec_info = forward_cost._chain_verify_input()(
                        positions=fb.positions, draft_token_num=width
                    )
                gated = kind in ("gated", "causal")
                with mtp_forward.step_gate(lora, K, lay) if gated else contextlib.nullcontext():
                    out = runner.forward(fb)
        runner.token_to_kv_pool_allocator.free(batch.out_cache_loc)
        return out.logits_output.next_token_logits.view(2, n, -1).clone()

    gated, ungated, chain = logits("gated"), logits("ungated"), logits("chain")
    causal = logits("causal")
    result = {
        "masks_tree_masked": bool((gated[:, K + 1 :] - causal[:, K + 1 :]).abs().amax() > 1e-3),
        "anchors_gate_free": bool(torch.equal(gated[:, : K + 1], ungated[:, : K + 1])),
        "masks_gated": bool((gated[:, K + 1 :] - ungated[:, K + 1 :]).abs().amax() > 1e-3),
        "anchors_as_chain": float((gated[:, : K + 1] - chain).abs().amax()),
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
