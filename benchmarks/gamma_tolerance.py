"""γ-tolerance τ(γ) = T(1)/T(γ) of the target forward, measured inside SGLang on this host.

    .venv/bin/python benchmarks/gamma_tolerance.py --json tau.json --plot tau.png

T(γ) is the latency of one EXTEND forward of SGLang's own ``ModelRunner`` that appends γ new
tokens per request on top of a cached prefix of ``ctx`` tokens: the target work of verifying a
chain of γ tokens, whose verify mask is the extend's causal mask (seed paper §3.1). Per
(batch size, ctx) the prefix is prefilled once and kept; ``--warmup`` + ``--iters`` rounds then
each run every γ once, in a shuffled order, so a drift in background load hits all γ alike.
Each forward gets a fresh batch whose γ KV slots are freed after it, so the cache never grows.
Only ``ModelRunner.forward`` is timed; batch construction is outside the clock. With
``--logits all`` (default) logits are computed at all γ appended positions, as a verify needs
(SGLang's input-logprob path, so a log-softmax over them is included); ``last`` computes only
a plain prefill's one row per request.

The script also prints the speedup that equation 1, S = λ·τ(γ+1) / (1 + γ·δ·τ(γ+1)),
predicts from these τ for each ``--lam`` and ``--delta``; ``sgl_spec.control.cost_model`` loads the
JSON as the controller's ``GammaTable``. On a CUDA-less host the same CPU settings as
``sgl_spec.launch_server`` are applied (``--device cpu``, ``SGLANG_USE_CPU_ENGINE=1``,
``--attention-backend intel_amx``, overlap schedule off) and sgl_kernel's CPU ops come from
``sgl_spec.cpu_kernels``. There the fallback's attention dominates the forward, so τ
describes that stack, not SGLang's native kernels (τ is a property of the serving stack, §3.2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _bench_lib import host_info  # noqa: E402

from sgl_spec.control.cost_model import predicted_speedup  # noqa: E402
from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path  # noqa: E402

SCHEMA_VERSION = 1
# Token ids of the synthetic prompts: inside any real vocabulary (tests use 512 tokens).
TOKEN_RANGE = (10, 250)


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}")
    return sorted(set(values))


def float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gamma_tolerance.py",
        allow_abbrev=False,
        description="Measure τ(γ)=T(1)/T(γ) of the target's extend forward inside SGLang.",
    )
    p.add_argument("--model-path", default=DEFAULT_TARGET, help="shipped name or directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gammas", type=int_list, default=int_list("1,2,4,8,16,25"))
    p.add_argument("--batch-sizes", type=int_list, default=int_list("1,8,32"))
    p.add_argument("--ctx-lens", type=int_list, default=int_list("128,512"))
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards per γ")
    p.add_argument("--iters", type=int, default=20, help="timed forwards per γ")
    p.add_argument("--logits", choices=("all", "last"), default="all")
    p.add_argument("--lam", type=float_list, default=float_list("1.5,2,2.5,3"))
    p.add_argument("--delta", type=float, default=0.0, help="T_D / T(1) for the S table")
    p.add_argument("--json", default="gamma_tolerance.json", help="result file")
    p.add_argument("--plot", default=None, help="PNG path (default: --json with .png)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads after load (default: SGLang's CPU binding). On a host "
        "shared with other jobs, 1 avoids OpenMP oversubscription stalls.",
    )
    args = p.parse_args(argv)
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    if 1 not in args.gammas:
        p.error("--gammas must include 1 (τ is relative to T(1))")
    if args.delta < 0:
        p.error("--delta must be >= 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.plot is None:
        args.plot = str(Path(args.json).with_suffix(".png"))
    try:
        args.model_path = resolve_model_path(args.model_path)
    except ValueError as exc:
        p.error(f"--model-path: {exc}")
    return args


def summarize(latencies_s: list[float]) -> dict:
    """Milliseconds: mean, median, p10, p90 (linear-interpolated quantiles)."""
    ms = sorted(1e3 * t for t in latencies_s)
    if len(ms) > 1:
        deciles = statistics.quantiles(ms, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = ms[0]
    return {
        "mean_ms": statistics.fmean(ms),
        "median_ms": statistics.median(ms),
        "p10_ms": p10,
        "p90_ms": p90,
        "num_iters": len(ms),
    }


def add_tau(points: list[dict]) -> None:
    """τ(γ) = median T(1) / median T(γ) within each (batch size, ctx)."""
    t1 = {(p["batch_size"], p["ctx_len"]): p["median_ms"] for p in points if p["gamma"] == 1}
    for p in points:
        p["tau"] = t1[(p["batch_size"], p["ctx_len"])] / p["median_ms"]


def speedup_rows(points: list[dict], lams: list[float], delta: float) -> list[dict]:
    """Equation 1 per measured verification length γ+1 = gamma (so γ drafts = gamma - 1)."""
    rows = []
    for p in points:
        num_drafts = p["gamma"] - 1
        if num_drafts < 1:
            continue
        rows.append(
            {
                "batch_size": p["batch_size"],
                "ctx_len": p["ctx_len"],
                "num_drafts": num_drafts,
                "tau": p["tau"],
                "speedup": {
                    str(lam): predicted_speedup(lam, p["tau"], num_drafts, delta) for lam in lams
                },
            }
        )
    return rows


def format_speedups(rows: list[dict], lams: list[float], delta: float) -> str:
    head = ["bs", "ctx", "drafts", "tau(g+1)"] + [f"S(lam={lam:g})" for lam in lams]
    lines = [f"predicted speedup, equation 1 (delta={delta:g}); tau at verify length drafts+1"]
    lines.append("  ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = [r["batch_size"], r["ctx_len"], r["num_drafts"], f"{r['tau']:.3f}"]
        cells += [f"{r['speedup'][str(lam)]:.3f}" for lam in lams]
        lines.append("  ".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def plot(points: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx_lens = sorted({p["ctx_len"] for p in points})
    fig, axes = plt.subplots(
        1, len(ctx_lens), figsize=(5 * len(ctx_lens), 4), squeeze=False, sharey=True
    )
    for ax, ctx in zip(axes[0], ctx_lens, strict=True):
        for bs in sorted({p["batch_size"] for p in points}):
            sel = sorted(
                (p for p in points if p["ctx_len"] == ctx and p["batch_size"] == bs),
                key=lambda p: p["gamma"],
            )
            ax.plot([p["gamma"] for p in sel], [p["tau"] for p in sel], "o-", label=f"bs={bs}")
        gammas = sorted({p["gamma"] for p in points})
        ax.plot(gammas, [1 / g for g in gammas], ":", color="gray", label="1/γ (compute-bound)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(gammas, [str(g) for g in gammas])
        ax.set_xlabel("γ (tokens per request in the forward)")
        ax.set_title(f"ctx={ctx}")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("τ(γ) = T(1) / T(γ)")
    axes[0][-1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- SGLang glue --------------------------------------------------------------------------


def prepare_environment(args: argparse.Namespace) -> None:
    """Before SGLang is imported: the CPU fallback hook and launch_server's CPU settings."""
    from sgl_spec.cpu_kernels.install import ensure_boot_hook
    from sgl_spec.launch_server import is_cpu_host

    ensure_boot_hook()
    if args.device is None:
        args.device = "cpu" if is_cpu_host() else "cuda"
    if args.device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        args.attention_backend = args.attention_backend or "intel_amx"


def load_runner(args: argparse.Namespace):
    """SGLang's ModelRunner built the way ``sglang.benchmark.one_batch`` builds it."""
    from sglang.benchmark import one_batch
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.utils import configure_logger

    max_bs = max(args.batch_sizes)
    max_tokens = max_bs * (max(args.ctx_lens) + max(args.gammas)) + 256
    server_args = ServerArgs(
        model_path=args.model_path,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        disable_overlap_schedule=True,
        disable_cuda_graph=True,
        disable_radix_cache=True,
        max_running_requests=max_bs,
        max_total_tokens=max_tokens,
        mem_fraction_static=0.5,
        random_seed=args.seed,
        log_level="error",
    )
    server_args.resolve_once()
    configure_logger(server_args)
    load_plugins()
    _set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    ranks = SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), gpu_id=0)
    publish(server_args, role="scheduler", ranks=ranks)
    one_batch._init_process_global_configs()
    bench_runner, _ = one_batch.load_model(server_args, port_args, 0, 0)
    runner = bench_runner.torch_runner
    longest = max(args.ctx_lens) + max(args.gammas)
    if longest > runner.model_config.context_len:
        raise SystemExit(
            f"gamma_tolerance.py: max --ctx-lens + max --gammas = {longest} exceeds the model's "
            f"context length {runner.model_config.context_len}"
        )
    return runner


def make_reqs(bs: int, ctx: int, max_gamma: int, rng, all_logits: bool) -> list:
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for i in range(bs):
        ids = array("q", (rng.randrange(*TOKEN_RANGE) for _ in range(ctx + max_gamma)))
        req = Req(
            rid=str(i),
            origin_input_text="",
            origin_input_ids=ids,
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
            return_logprob=all_logits,
        )
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = ctx
        req.extend_end = ctx
        reqs.append(req)
    return reqs


def build_extend(runner, reqs: list, start: int, end: int):
    """ScheduleBatch + ForwardBatch extending every request from ``start`` to ``end`` tokens."""
    from sglang.benchmark.one_batch import TreeCacheNamespace, _maybe_prepare_mlp_sync_batch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for req in reqs:
        req.prefix_len, req.extend_end = start, end
    tree_cache = TreeCacheNamespace(
        page_size=get_schedule().page_size,
        device=runner.device,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
    )
    batch = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        tree_cache=tree_cache,
        model_config=runner.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    _maybe_prepare_mlp_sync_batch(batch, runner)
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        batch.prefill_input_ids_cpu = None
    return batch, ForwardBatch.init_new(batch, runner, return_hidden_states_before_norm=False)


def synchronize(device: str) -> None:
    import torch

    torch.get_device_module(device).synchronize()


def time_forward(runner, forward_batch) -> float:
    import torch

    with torch.no_grad():
        synchronize(runner.device)
        tic = time.perf_counter()
        runner.forward(forward_batch)
        synchronize(runner.device)
        return time.perf_counter() - tic


def measure(runner, args: argparse.Namespace) -> list[dict]:
    import random

    import torch

    rng = random.Random(args.seed)
    points = []
    for bs in args.batch_sizes:
        for ctx in args.ctx_lens:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
            reqs = make_reqs(bs, ctx, max(args.gammas), rng, args.logits == "all")
            _, prefill = build_extend(runner, reqs, 0, ctx)
            with torch.no_grad():
                runner.forward(prefill)
            latencies: dict[int, list[float]] = {gamma: [] for gamma in args.gammas}
            order = list(args.gammas)
            for round_i in range(args.warmup + args.iters):
                rng.shuffle(order)
                for gamma in order:
                    batch, forward_batch = build_extend(runner, reqs, ctx, ctx + gamma)
                    elapsed = time_forward(runner, forward_batch)
                    runner.token_to_kv_pool_allocator.free(batch.out_cache_loc)
                    if round_i >= args.warmup:
                        latencies[gamma].append(elapsed)
            for gamma in args.gammas:
                point = {"batch_size": bs, "ctx_len": ctx, "gamma": gamma}
                point.update(summarize(latencies[gamma]))
                points.append(point)
                print(
                    f"bs={bs:<4} ctx={ctx:<5} gamma={gamma:<3} "
                    f"median={point['median_ms']:.3f} ms  p10={point['p10_ms']:.3f}  "
                    f"p90={point['p90_ms']:.3f}",
                    flush=True,
                )
    add_tau(points)
    return points


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    prepare_environment(args)
    runner = load_runner(args)
    import torch  # after prepare_environment: the sgl_kernel hook must come first

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    points = measure(runner, args)
    rows = speedup_rows(points, args.lam, args.delta)
    result = {
        "schema_version": SCHEMA_VERSION,
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "host": {**host_info(), "torch_threads": torch.get_num_threads()},
        "model": args.model_path,
        "dtype": args.dtype,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "logits": args.logits,
        "warmup": args.warmup,
        "iters": args.iters,
        "batch_sizes": args.batch_sizes,
        "ctx_lens": args.ctx_lens,
        "gammas": args.gammas,
        "points": points,
        "predicted_speedup": {"delta": args.delta, "lams": args.lam, "rows": rows},
    }
    for p in points:
        if not (math.isfinite(p["median_ms"]) and p["median_ms"] > 0):
            raise RuntimeError(f"bad latency measured: {p}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    plot(points, args.plot, f"γ-tolerance, {Path(args.model_path).name} on {args.device}")
    print(format_speedups(rows, args.lam, args.delta))
    print(f"wrote {args.json} and {args.plot}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
