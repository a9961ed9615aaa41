"""What SGLang's CPU graph runner's compile is worth per forward, against the eager forward.

    .venv/bin/python benchmarks/compiled_forward.py --json benchmarks/results/compiled_forward.json

Per model (the shipped target and draft, ``--models``), batch size and ``--num-tokens`` (1: a
DECODE forward; n > 1: a TARGET_VERIFY forward of an n-token chain, what every algorithm's
verify runs, which SGLang's runner does not compile yet), in one process per model:
``model.forward`` eager, compiled as SGLang's CPU graph runner compiles a decode (its fakes and
inductor settings, ``dynamic=False``) with dynamo's default guards,
and compiled with the guards on ``nn.Module`` attributes skipped (torch's
``skip_guard_on_all_nn_modules_unsafe``: a served model's modules do not change after start-up,
and the graph holds its weights as frozen constants anyway); then the whole served eager forward
(``ModelRunner.forward``) for scale. The variants alternate forward by forward (ABBA) on the
same batch, so host drift falls on all alike; the compiled logits must equal the eager ones.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import forward_cost  # noqa: E402

VARIANTS = ("eager", "compiled", "compiled_no_module_guards")


def parse_args(argv: list[str]) -> argparse.Namespace:
    return forward_cost.timing_args("compiled_forward.py", argv, num_tokens=True)


def _call(runner, fb, fn):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    runner.attn_backend.init_forward_metadata(fb)
    with forward_context(ForwardContext(attn_backend=runner.attn_backend), forward_batch=fb):
        return fn(fb.input_ids, fb.positions, fb)


def _functions(runner) -> dict:
    import torch

    model = runner.model

    # two functions, two code objects: dynamo caches compiled frames per code object, so one
    # function compiled twice would serve both variants from the first one's cache
    @torch.no_grad()
    def guarded(input_ids, positions, forward_batch):
        return model.forward(input_ids, positions, forward_batch)

    @torch.no_grad()
    def module_guards_skipped(input_ids, positions, forward_batch):
        return model.forward(input_ids, positions, forward_batch)

    skip = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    return {
        "eager": torch.no_grad()(model.forward),
        "compiled": torch.compile(guarded, dynamic=False),
        "compiled_no_module_guards": torch.compile(
            module_guards_skipped, dynamic=False, options=skip
        ),  # fmt: skip
        "served_eager": runner.forward,
    }


def _time_point(runner, fb, args: argparse.Namespace) -> dict:
    import torch

    fns = _functions(runner)
    times: dict[str, list[float]] = {name: [] for name in fns}
    logits = {}
    order = list(fns)
    with torch.no_grad():
        for name in VARIANTS:  # compile outside the timed loop
            logits[name] = _call(runner, fb, fns[name]).next_token_logits.clone()
        for i in range(args.warmup + args.iters):
            for name in order if i % 2 else reversed(order):
                tic = time.perf_counter()
                if name == "served_eager":
                    fns[name](fb)
                else:
                    _call(runner, fb, fns[name])
                if i >= args.warmup:
                    times[name].append((time.perf_counter() - tic) * 1e3)
    point = {f"{name}_ms": statistics.median(ts) for name, ts in times.items()}
    for name in VARIANTS[1:]:
        point[f"{name}_over_eager"] = point[f"{name}_ms"] / point["eager_ms"]
        point[f"{name}_logits_equal"] = bool(torch.equal(logits[name], logits["eager"]))
    return point


def _batch(runner, reqs, ctx: int, n: int):
    """A DECODE batch (``n`` = 1) or a TARGET_VERIFY batch of an ``n``-token chain after
    ``ctx`` cached tokens, and the KV slots it writes."""
    if n == 1:
        return forward_cost.decode_after(runner, reqs, ctx)
    from gamma_tolerance import build_extend

    batch, _ = build_extend(runner, reqs, ctx, ctx + n)
    return forward_cost._verify_batch(runner, batch, n), batch.out_cache_loc


def run_worker(model_path: str, args: argparse.Namespace) -> list[dict]:
    fc_args = forward_cost.parse_args(
        ["--batch-sizes", ",".join(map(str, args.batch_sizes)), "--num-tokens",
         ",".join(map(str, args.num_tokens)), "--ctx-len", str(args.ctx_len)]
    )  # fmt: skip
    runner = forward_cost._load_runner(model_path, fc_args)
    import torch._dynamo
    import torch._inductor.config
    from sglang.srt.model_executor import cpu_graph_runner

    cpu_graph_runner.register_fake_ops(1)
    cpu_graph_runner.set_torch_compile_config()
    torch._inductor.config.fx_graph_cache = False  # compile what this process has
    points = []
    for bs in args.batch_sizes:
        reqs = forward_cost.prefilled(runner, bs, args.ctx_len, max(args.num_tokens) + 1,
                                      random.Random(0))  # fmt: skip
        for n in args.num_tokens:
            torch._dynamo.reset()  # each point's graphs alone in dynamo's cache
            fb, locs = _batch(runner, reqs, args.ctx_len, n)
            point = {"model": model_path, "batch_size": bs, "num_tokens": n,
                     **_time_point(runner, fb, args)}  # fmt: skip
            runner.token_to_kv_pool_allocator.free(locs)
            points.append(point)
            print(f"{Path(model_path).name} bs={bs} n={n}: eager {point['eager_ms']:.3f} ms, "
                  f"compiled {point['compiled_over_eager']:.3f}x, without module guards "
                  f"{point['compiled_no_module_guards_over_eager']:.3f}x, served eager "
                  f"{point['served_eager_ms']:.3f} ms", flush=True)  # fmt: skip
    return points


def main(argv: list[str]) -> dict:
    return forward_cost.per_model(str(Path(__file__).resolve()), argv, parse_args(argv), run_worker)


if __name__ == "__main__":
    main(sys.argv[1:])
