"""Run by ``tests/unit/test_cpu_plain_llama.py`` in its own process (SGLang's model runner
keeps process-wide state): one model's logits and captured features through the patched
``LlamaModel.forward`` and through upstream's, for a prefill, a decode and a verify chain.

    python tests/helpers/plain_llama_check.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import forward_cost  # noqa: E402


def _forward(runner, fb, plain: bool):
    """Logits and captured features of ``fb`` with the plain stack on or off."""
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    inner = runner.model.model
    inner.__dict__["_sgl_spec_plain"] = plain  # the patch's cached per-model decision
    runner.attn_backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=runner.attn_backend),
                                          forward_batch=fb):  # fmt: skip
        out = inner.forward(fb.input_ids, fb.positions, fb)
    hidden, aux = out if isinstance(out, tuple) else (out, [])
    return hidden.clone(), [a.clone() for a in aux]


def main(model: str, out_path: str) -> None:
    args = forward_cost.parse_args(["--batch-sizes", "2", "--num-tokens", "1,4", "--ctx-len", "24"])
    runner = forward_cost._load_runner(model, args)
    import torch
    from gamma_tolerance import build_extend, make_reqs

    from sgl_spec.patches import cpu_plain_llama

    inner = runner.model.model
    result = {"serves": cpu_plain_llama.plain_stack(inner), "cases": {}}
    runner.model.set_eagle3_layers_to_capture([0, 1])  # features at layers 1 and 2's inputs
    rng = random.Random(0)
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    reqs = make_reqs(2, 24, 4, rng, all_logits=True)
    cases = {"prefill": build_extend(runner, reqs, 0, 24)[1]}
    runner.forward(cases["prefill"])
    cases["decode"] = forward_cost.decode_after(runner, reqs, 24)[0]
    verify, _ = build_extend(runner, reqs, 24, 28)
    cases["verify"] = forward_cost._verify_batch(runner, verify, 4)
    for name, fb in cases.items():
        upstream = _forward(runner, fb, False)
        plain = _forward(runner, fb, True)
        result["cases"][name] = {
            "hidden_equal": bool(torch.equal(upstream[0], plain[0])),
            "captures": [len(upstream[1]), len(plain[1])],
            "captures_equal": len(upstream[1]) == len(plain[1])
            and all(torch.equal(a, b) for a, b in zip(upstream[1], plain[1], strict=True)),
        }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
