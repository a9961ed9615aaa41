"""Run by ``tests/unit/test_compiled_forwards.py`` in its own process (SGLang's model runner and
torch.compile keep process-wide state): one model's layer stack compiled for a decode and a
chain verify (``sgl_spec/common/compiled_forwards.py``), then served real batches of those
shapes and of others, against the eager stack.

    python tests/helpers/compiled_forwards_check.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
# compile what this process has: the capture turns inductor's FX graph cache on (SGLang's
# compile settings), so it gets a cache of its own
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compiled-forwards-check-")

import forward_cost  # noqa: E402

BS, WIDTH = 2, 3


def _hidden(runner, fb, fn):
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    runner.attn_backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=runner.attn_backend),
                                          forward_batch=fb):  # fmt: skip
        out = fn(fb.input_ids, fb.positions, fb)
    return (out[0] if isinstance(out, tuple) else out).clone()


def _verify(runner, reqs, ctx: int, n: int):
    from gamma_tolerance import build_extend

    batch, _ = build_extend(runner, reqs, ctx, ctx + n)
    return forward_cost._verify_batch(runner, batch, n), batch.out_cache_loc


class _Tree:
    """A verify's ``spec_info`` under a tree mask: a star (every node a child of the first)."""

    tree_topk = -1

    def __init__(self, seq_lens, n: int) -> None:
        import torch

        masks = []
        for prefix in seq_lens.tolist():
            mask = torch.zeros(n, prefix + n, dtype=torch.bool)
            mask[:, : prefix + 1] = True
            mask[torch.arange(n), prefix + torch.arange(n)] = True
            masks.append(mask.flatten())
        self.draft_token_num, self.custom_mask = n, torch.cat(masks)


def _written(runner, fb):
    """The K and V rows the forward wrote, every layer."""
    import torch

    pool, locs = runner.token_to_kv_pool, fb.out_cache_loc.to(torch.int64)
    return [
        t[locs].clone() for pair in zip(pool.k_buffer, pool.v_buffer, strict=True) for t in pair
    ]


def _compare(runner, stack, fb) -> dict:
    """The stack's output and the KV rows it wrote, served through the installed dispatcher
    and eager."""
    import torch

    served_before = len(stack.served)
    compiled = _hidden(runner, fb, runner.model.model)
    compiled_kv = _written(runner, fb)
    eager = _hidden(runner, fb, stack.eager)
    kv_equal = all(
        torch.equal(a, b) for a, b in zip(compiled_kv, _written(runner, fb), strict=True)
    )
    return {"equal": bool(torch.equal(compiled, eager)) and kv_equal,
            "newly_served": len(stack.served) - served_before}  # fmt: skip


def main(model: str, out_path: str) -> None:
    args = forward_cost.parse_args(["--batch-sizes", str(BS), "--num-tokens", str(WIDTH),
                                    "--ctx-len", "24"])  # fmt: skip
    runner = forward_cost._load_runner(model, args)
    import torch
    import torch._dynamo.utils

    from sgl_spec.common.compiled_forwards import CompiledStack, Shape

    stack = CompiledStack(runner, "check", width_per_backend=True)  # verifies set their width
    stack.capture([Shape("DECODE", BS, 1), Shape("TARGET_VERIFY", BS, WIDTH),
                   Shape("TARGET_VERIFY", BS, WIDTH, tree=True)])  # fmt: skip
    stack.install()
    graphs_after_capture = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result: dict = {"captured": sorted(f"{s.mode}:{s.tokens}:{int(s.tree)}" for s in stack.graphs)}
    rng = random.Random(0)
    for ctx in (20, 33):  # other lengths than the capture's, other KV slots
        reqs = forward_cost.prefilled(runner, BS, ctx, WIDTH + 2, rng)
        fb, locs = _verify(runner, reqs, ctx, WIDTH)
        result[f"verify_{ctx}"] = _compare(runner, stack, fb)
        fb.spec_info = _Tree(fb.seq_lens, WIDTH)  # the same tokens under a tree mask
        result[f"tree_{ctx}"] = _compare(runner, stack, fb)
        runner.token_to_kv_pool_allocator.free(locs)
        fb, locs = forward_cost.decode_after(runner, reqs, ctx)
        fb.out_cache_loc = torch.stack([locs, locs], dim=1)[:, 0]  # a strided column
        result[f"decode_{ctx}"] = _compare(runner, stack, fb)
        runner.token_to_kv_pool_allocator.free(locs)
    reqs = forward_cost.prefilled(runner, BS, 28, WIDTH + 2, rng)
    fb, locs = _verify(runner, reqs, 28, WIDTH - 1)  # a width not captured: eager
    result["other_width"] = _compare(runner, stack, fb)
    runner.token_to_kv_pool_allocator.free(locs)
    fb, locs = _verify(runner, reqs, 28, WIDTH)
    runner.attn_backend.num_draft_tokens = WIDTH + 1  # a constant the graph guards on differs
    result["refused"] = _compare(runner, stack, fb)
    result["refusals"] = sum(stack.refusals.values())
    result["new_graphs_while_serving"] = (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_after_capture
    )
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
