"""Run by ``tests/unit/test_cpu_compiled_decode.py`` in its own process (SGLang's model runner
and torch.compile keep process-wide state): one model's DECODE forward compiled as SGLang's CPU
graph runner compiles it (its fakes and inductor settings, ``dynamic=False``) against the
eager forward, with what the compiled graphs hold.

    python tests/helpers/compiled_decode_check.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import forward_cost  # noqa: E402


def _call(runner, fb, fn):
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    runner.attn_backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=runner.attn_backend),
                                          forward_batch=fb):  # fmt: skip
        return fn(fb.input_ids, fb.positions, fb).next_token_logits.clone()


def main(model: str, out_path: str) -> None:
    args = forward_cost.parse_args(["--batch-sizes", "2", "--num-tokens", "1", "--ctx-len", "24"])
    runner = forward_cost._load_runner(model, args)
    import torch
    import torch._inductor.config
    from sglang.srt.model_executor import cpu_graph_runner

    pool = runner.token_to_kv_pool
    from sgl_spec.patches.cpu_kv_split import shared as one_allocation

    shared = [one_allocation(k, v) for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True)]
    cpu_graph_runner.register_fake_ops(1)
    cpu_graph_runner.set_torch_compile_config()
    torch._inductor.config.fx_graph_cache = False  # compile what this process has
    reqs = forward_cost.prefilled(runner, 2, 24, 2, random.Random(0))
    fb = forward_cost.decode_after(runner, reqs, 24)[0]
    eager = _call(runner, fb, runner.model.forward)
    explained = torch._dynamo.explain(runner.model.forward)
    runner.attn_backend.init_forward_metadata(fb)
    compiled_fn = torch.compile(torch.no_grad()(runner.model.forward), dynamic=False)
    compiled = _call(runner, fb, compiled_fn)
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=runner.attn_backend),
                                          forward_batch=fb):  # fmt: skip
        report = explained(fb.input_ids, fb.positions, fb)
    first = report.graphs[0]
    result = {
        "kv_shared": shared,
        "logits_equal": bool(torch.equal(eager, compiled)),
        "graphs": report.graph_count,
        "attention_ops_in_first_graph": sum(
            "decode_attention" in str(node.target) for node in first.graph.nodes
        ),
        "layers": len(runner.model.model.layers),
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
