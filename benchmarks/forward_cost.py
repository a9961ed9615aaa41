"""What one forward costs: bare PyTorch (Hugging Face) against SGLang's served forward.

    .venv/bin/python benchmarks/forward_cost.py --json benchmarks/results/forward_cost.json

For the shipped target and draft (``--models``), batch sizes 1 and 8, a cached context of 256
tokens and 1, 4, 16 new tokens per request, it times in one process per model:

- *bare*: ``transformers``' forward of the new tokens on a ``DynamicCache`` holding the context
  (logits at every new position, as a verify needs); the cache is cropped back after each call;
- *served*: SGLang's ``ModelRunner.forward`` on the same shapes: a DECODE batch for 1 token
  (what a plain decode step or a draft step runs), a TARGET_VERIFY batch of a causal chain
  for more (what a verify runs: logits at every new position, no log-probabilities), KV in
  SGLang's paged pool through the attention
  backend the server uses (on a CPU host: ``intel_amx`` with ``sgl_spec.cpu_kernels``).

With ``--draft-token-map FILE`` a third process times the draft with its LM head cut to that
hot vocabulary (``--speculative-token-map``, as STANDALONE_FULL serves it), bare and served
alike (rows of model ``<draft>+hot``). With ``--mtp-adapter`` another process times MTP_LORA's step on the target: the gated tree
verify of (k+1)² tokens a request for each ``--mtp-ks`` k, beside a plain chain of that width
(``mtp_forward.py``; served only, rows with ``shape`` and ``mtp_k``).

Bare and served forwards of each shape alternate in a shuffled order, so drift hits both
alike; each process gets the launcher's environment defaults (``launcher_env``).

Caveat: the served forward here runs in a plain Python process, not in a scheduler process;
on the AMD host of RESULTS' 2026-11-25 entry (commit 2395372) its 1-row float32 linears ran MKL's generic
sgemv (py-spy) where samples of the served scheduler showed PyTorch's own GEMM kernel, and
served times here exceeded the server's per-token time at batch 1. Compare its ratios with
``bench_speculative.py``'s, not its absolute times with the server's. The models run in separate processes in ABBA order (``--rounds``), and medians pool
over rounds. Printed: served/bare per shape, served T(4)/T(1) and T(16)/T(1) per model and
batch size, and the served draft forward as a share of the served target forward.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _bench_lib import host_info  # noqa: E402

from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402

SCHEMA_VERSION = 1
TOKEN_RANGE = (10, 250)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="forward_cost.py", allow_abbrev=False)
    p.add_argument("--models", default=f"{DEFAULT_TARGET},{DEFAULT_DRAFT}",
                   help="target,draft: shipped names or directories")  # fmt: skip
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--num-tokens", default="1,4,16")
    p.add_argument("--ctx-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds of the two models")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: SGLang's)")
    p.add_argument("--mtp-adapter", default=None,
                   help="also time MTP_LORA's gated step on the target with this adapter"
                   " (a shipped name or directory; mtp_forward.py)")  # fmt: skip
    p.add_argument("--mtp-ks", default="2", help="the k of each MTP_LORA step timed")
    p.add_argument("--draft-token-map", default=None,
                   help="also time the draft with its LM head cut to this hot vocabulary"
                   " (--speculative-token-map; bare and served alike)")  # fmt: skip
    p.add_argument("--json", default="forward_cost.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one model, in-process
    p.add_argument("--worker-mtp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-hot", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    args.num_tokens = [int(v) for v in args.num_tokens.split(",")]
    args.mtp_ks = [int(v) for v in args.mtp_ks.split(",")]
    if min(args.mtp_ks) < 1:
        p.error("--mtp-ks must be >= 1")
    if args.warmup < 0 or args.iters < 1 or args.rounds < 1:
        p.error("--warmup must be >= 0, --iters and --rounds >= 1")
    return args


# ---- one model, in its own process ----------------------------------------------------------


def _load_runner(model_path: str, args: argparse.Namespace):
    from gamma_tolerance import load_runner, prepare_environment

    ns = argparse.Namespace(
        model_path=model_path, device=None, attention_backend=None, dtype="float32", seed=0,
        batch_sizes=args.batch_sizes, ctx_lens=[args.ctx_len], gammas=args.num_tokens,
    )  # fmt: skip
    prepare_environment(ns)
    return load_runner(ns)


def _decode_batch(runner, batch):
    """A DECODE ForwardBatch of one new token per request of ``batch`` (its extend done)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    seq_lens = batch.seq_lens.to(torch.int64)
    locs = runner.token_to_kv_pool_allocator.alloc(len(seq_lens))
    rows = batch.req_pool_indices.to(torch.int64)
    runner.req_to_token_pool.req_to_token[rows, seq_lens] = locs.to(torch.int32)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(seq_lens),
        input_ids=batch.input_ids.view(len(seq_lens), -1)[:, 0].contiguous(),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=seq_lens + 1,
        seq_lens_cpu=(seq_lens + 1).cpu(),
        seq_lens_sum=int((seq_lens + 1).sum()),
        out_cache_loc=locs,
        positions=seq_lens,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        spec_algorithm=runner.spec_algorithm,
        return_hidden_states_before_norm=False,
    )
    runner.kv_index_translator.bind_own_plan(fb)
    return fb, locs


@functools.cache
def _chain_verify_input() -> type:
    """The spec_info class of a verify of a plain chain (built once, after SGLang's import)."""
    from sgl_spec.mtp.info import MtpForwardInput

    class ChainVerifyInput(MtpForwardInput):
        @property
        def tree_topk(self) -> int:
            return 1  # a chain: the backend's built-in causal mask, no custom mask

    return ChainVerifyInput


def _verify_batch(runner, batch, n: int, input_ids=None, offsets=None, custom_mask=None):
    """A TARGET_VERIFY ForwardBatch of ``n`` tokens per request on ``batch``'s extend slots:
    what a verify runs (logits at every new position, no log-probabilities -- an EXTEND batch
    asking for every position's logits would also compute input log-probabilities, which no
    verify does). By default a causal chain of the extend's tokens; else ``input_ids`` [bs, n]
    at position offsets ``offsets`` [n] under the tree mask ``custom_mask`` (the backend's
    format), as MTP_LORA's step (``mtp_forward.py``)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    from sgl_spec.mtp.info import MtpForwardInput

    bs = len(batch.reqs)
    prefix = (batch.seq_lens - n).to(torch.int64)
    offsets = torch.arange(n) if offsets is None else offsets.to(torch.int64)
    positions = (prefix[:, None] + offsets[None, :]).reshape(-1)
    if custom_mask is None:
        spec_info = _chain_verify_input()(positions=positions, draft_token_num=n)
    else:
        spec_info = MtpForwardInput(positions=positions, custom_mask=custom_mask, draft_token_num=n)
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=(batch.input_ids if input_ids is None else input_ids).reshape(-1),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=prefix,
        seq_lens_cpu=prefix.cpu() + n,
        seq_lens_sum=int(prefix.sum()) + n * bs,
        out_cache_loc=batch.out_cache_loc,
        positions=positions,
        spec_algorithm=runner.spec_algorithm,
        spec_info=spec_info,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        return_hidden_states_before_norm=False,
    )
    runner.kv_index_translator.bind_own_plan(fb)
    # the backend takes a verify's width from the server's speculative settings, which this
    # non-speculative runner has not set
    runner.attn_backend.num_draft_tokens = n
    return fb


def decode_after(runner, reqs, ctx: int):
    """A DECODE ForwardBatch of one new token per request of ``reqs`` after ``ctx`` cached
    tokens, and the KV slots it writes (the caller frees them)."""
    from gamma_tolerance import build_extend

    batch, _ = build_extend(runner, reqs, ctx, ctx + 1)
    runner.token_to_kv_pool_allocator.free(batch.out_cache_loc)
    batch.seq_lens = batch.seq_lens - 1  # the decode appends the one token itself
    return _decode_batch(runner, batch)


def _served_forward(runner, reqs, ctx: int, n: int):
    """Time one served forward of ``n`` new tokens per request; frees its KV slots."""
    from gamma_tolerance import build_extend, time_forward

    if n == 1:
        fb, locs = decode_after(runner, reqs, ctx)
        elapsed = time_forward(runner, fb)
        runner.token_to_kv_pool_allocator.free(locs)
        return elapsed
    batch, _ = build_extend(runner, reqs, ctx, ctx + n)
    elapsed = time_forward(runner, _verify_batch(runner, batch, n))
    runner.token_to_kv_pool_allocator.free(batch.out_cache_loc)
    return elapsed


def _bare_model(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


def _bare_forward(model, cache, ids, ctx: int) -> float:
    """Time the HF forward of ``ids`` [bs, n] on ``cache`` (ctx tokens); crop back after."""
    import torch

    with torch.no_grad():
        tic = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        elapsed = time.perf_counter() - tic
    cache.crop(ctx)
    return elapsed


def prefilled(runner, bs: int, ctx: int, max_new: int, rng: random.Random) -> list:
    """``bs`` fresh requests with ``ctx`` tokens already in the runner's KV pool (the pools
    cleared first), room for ``max_new`` more each."""
    import torch
    from gamma_tolerance import build_extend, make_reqs

    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    reqs = make_reqs(bs, ctx, max_new, rng, all_logits=True)
    _, prefill = build_extend(runner, reqs, 0, ctx)
    with torch.no_grad():
        runner.forward(prefill)
    return reqs


def _cut_heads(runner, model, token_map: str) -> None:
    """Both heads on the map's rows: the served model's as STANDALONE_FULL's draft worker cuts
    it (``hot_vocab.install``), the bare one's the same way."""
    from types import SimpleNamespace

    import torch

    from sgl_spec.standalone import hot_vocab

    hot = torch.tensor(torch.load(token_map, weights_only=True), dtype=torch.int64)
    hot_vocab.install(SimpleNamespace(draft_runner=runner, hot_token_id=hot))
    weight = model.get_output_embeddings().weight.detach()[hot].clone()
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    model.set_output_embeddings(head)  # the input embedding stays whole


def run_worker(model_path: str, args: argparse.Namespace) -> dict:
    """Median bare and served latency (ms) per (batch size, new tokens) for one model (with
    ``--worker-hot``, its head cut to ``--draft-token-map``)."""
    runner = _load_runner(model_path, args)
    import torch
    from transformers import DynamicCache

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = _bare_model(model_path)
    if args.worker_hot:
        _cut_heads(runner, model, args.draft_token_map)
    rng = random.Random(0)
    points = []
    ctx = args.ctx_len
    for bs in args.batch_sizes:
        reqs = prefilled(runner, bs, ctx, max(args.num_tokens), rng)
        ids = torch.tensor([list(r.origin_input_ids) for r in reqs], dtype=torch.int64)
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids[:, :ctx], past_key_values=cache, use_cache=True)
        times = {(kind, n): [] for kind in ("bare", "served") for n in args.num_tokens}
        order = list(times)
        for i in range(args.warmup + args.iters):
            rng.shuffle(order)
            for kind, n in order:
                if kind == "bare":
                    t = _bare_forward(model, cache, ids[:, ctx : ctx + n], ctx)
                else:
                    t = _served_forward(runner, reqs, ctx, n)
                if i >= args.warmup:
                    times[(kind, n)].append(t * 1e3)
        for n in args.num_tokens:
            point = {"batch_size": bs, "num_tokens": n, "ctx_len": ctx}
            for kind in ("bare", "served"):
                point[f"{kind}_ms"] = statistics.median(times[(kind, n)])
            points.append(point)
            print(f"{Path(model_path).name} bs={bs} n={n}: bare {point['bare_ms']:.2f} ms,"
                  f" served {point['served_ms']:.2f} ms", flush=True)  # fmt: skip
    name = f"{model_path}+hot" if args.worker_hot else model_path
    return {"model": name, "torch_threads": torch.get_num_threads(), "points": points}


# ---- orchestration: ABBA over the two models, pooled ----------------------------------------


def launcher_env() -> dict[str, str]:
    """This process's environment plus what the CPU launcher sets for a server's processes
    unless set already (malloc settings, SGLang's eager input copy off)."""
    from sgl_spec.launch_server import CPU_ENGINE_ENV, CPU_MALLOC_ENV

    return {**CPU_MALLOC_ENV, **CPU_ENGINE_ENV, **os.environ}


def _spawn(model: str, args: argparse.Namespace, argv: list[str], out: Path) -> dict:
    """One worker process; ``model`` ending in ``+mtp`` times the target's MTP_LORA step, in
    ``+hot`` the draft on ``--draft-token-map``."""
    kind = model.rpartition("+")[2] if model.endswith(("+mtp", "+hot")) else None
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv,
           "--worker", model.removesuffix(f"+{kind}"), *([f"--worker-{kind}"] if kind else []),
           "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, env=launcher_env())
    return json.loads(out.read_text())


def timing_args(prog: str, argv: list[str], num_tokens: bool = False) -> argparse.Namespace:
    """The options of an in-process timing script run through :func:`per_model`;
    ``num_tokens`` adds ``--num-tokens`` (1: a decode, n > 1: a verify of an n-token chain)."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    if num_tokens:
        p.add_argument("--num-tokens", default="1")
    p.add_argument("--models", default=f"{DEFAULT_TARGET},{DEFAULT_DRAFT}")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--ctx-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--json", default=f"{Path(prog).stem}.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    if num_tokens:
        args.num_tokens = [int(v) for v in args.num_tokens.split(",")]
        if min(args.num_tokens) < 1:
            p.error("--num-tokens must be >= 1")
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0, --iters >= 1")
    return args


def per_model(script: str, argv: list[str], args: argparse.Namespace, run_worker) -> dict:
    """``main`` of an in-process timing script with ``--models``, ``--json`` and a hidden
    ``--worker``: as a worker, time one model (``run_worker(model_path, args)``, a list of
    points) into ``--json``; else run one worker process per model, with the launcher's
    environment, and write their points with the command and host to ``--json``."""
    from sgl_spec.models.registry import resolve_model_path

    if args.worker is not None:
        points = run_worker(resolve_model_path(args.worker), args)
        Path(args.json).write_text(json.dumps(points) + "\n")
        return {"points": points}
    passthrough = [a for a in argv if not a.startswith("--json") and a != args.json]
    points = []
    for model in args.models.split(","):
        out = Path(args.json).with_suffix(f".{Path(model).name}.part")
        cmd = [sys.executable, script, *passthrough, "--worker", model, "--json", str(out)]
        subprocess.run(cmd, check=True, env=launcher_env())
        points += json.loads(out.read_text())
        out.unlink()
    result = {"command": " ".join([f"benchmarks/{Path(script).name}", *argv]),
              "host": host_info(), "points": points}  # fmt: skip
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def pool_runs(runs: list[dict]) -> list[dict]:
    """Median over runs of each (model, batch size, tokens, shape) point's medians; an MTP
    step's rows (``shape``, ``mtp_k``) have no bare forward."""
    pooled: dict[tuple, dict] = {}
    for run in runs:
        for p in run["points"]:
            key = (run["model"], p["batch_size"], p["num_tokens"], p.get("shape"))
            entry = pooled.setdefault(key, {"bare": [], "served": [], "mtp_k": p.get("mtp_k")})
            if p["bare_ms"] is not None:
                entry["bare"].append(p["bare_ms"])
            entry["served"].append(p["served_ms"])
    rows = []
    for (model, bs, n, shape), entry in pooled.items():
        served = statistics.median(entry["served"])
        bare = statistics.median(entry["bare"]) if entry["bare"] else None
        row = {"model": model, "batch_size": bs, "num_tokens": n, "bare_ms": bare,
               "served_ms": served, "served_over_bare": None if bare is None else served / bare}  # fmt: skip
        if shape is not None:
            row.update(shape=shape, mtp_k=entry["mtp_k"])
        rows.append(row)
    return rows


def summary(rows: list[dict], target: str, draft: str) -> dict:
    """T(n)/T(1) per model and batch size, draft/target per shape (served forwards)."""
    served = {
        (r["model"], r["batch_size"], r["num_tokens"]): r["served_ms"]
        for r in rows
        if "shape" not in r
    }
    tau, share = {}, {}
    for model, bs, n in served:
        if n != 1:
            tau[f"{Path(model).name} bs={bs} T({n})/T(1)"] = (
                served[(model, bs, n)] / served[(model, bs, 1)]
            )
        if model in (draft, f"{draft}+hot") and (target, bs, n) in served:
            hot = " hot" if model != draft else ""
            share[f"bs={bs} n={n}{hot}"] = served[(model, bs, n)] / served[(target, bs, n)]
    return {"served_tau": tau, "draft_over_target": share}


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    from sgl_spec.models.registry import resolve_model_path

    if args.worker is not None and args.worker_mtp:
        from mtp_forward import run_mtp_worker

        adapter = resolve_model_path(args.mtp_adapter)
        result = run_mtp_worker(resolve_model_path(args.worker), adapter, args)
        Path(args.json).write_text(json.dumps(result) + "\n")
        return result
    if args.worker is not None:
        result = run_worker(resolve_model_path(args.worker), args)
        Path(args.json).write_text(json.dumps(result) + "\n")
        return result
    target, draft = (resolve_model_path(m) for m in args.models.split(","))
    passthrough = [a for a in argv if not a.startswith("--json") and a != args.json]
    tmp = Path(args.json).with_suffix(".runs")
    tmp.mkdir(parents=True, exist_ok=True)
    order = [target, draft] + ([f"{draft}+hot"] if args.draft_token_map else [])
    order += [f"{target}+mtp"] if args.mtp_adapter else []
    runs = []
    for r in range(args.rounds):
        for i, model in enumerate(order + order[::-1]):
            runs.append(_spawn(model, args, passthrough, tmp / f"r{r}_{i}.json"))
    rows = pool_runs(runs)
    result = {
        "schema_version": SCHEMA_VERSION,
        "command": " ".join(["benchmarks/forward_cost.py", *argv]),
        "host": host_info(),
        "torch_threads": runs[0]["torch_threads"],
        "target": target,
        "draft": draft,
        "rows": rows,
        **summary(rows, target, draft),
    }
    print(f"{'model':<20} {'bs':>3} {'n':>3} {'bare ms':>9} {'served ms':>10} {'served/bare':>12}")
    for r in rows:
        name = Path(r["model"]).name + (f" {r['shape']} k={r['mtp_k']}" if "shape" in r else "")
        bare, ratio = r["bare_ms"], r["served_over_bare"]
        print(f"{name:<20} {r['batch_size']:>3} {r['num_tokens']:>3}"
              f" {'-' if bare is None else f'{bare:.2f}':>9} {r['served_ms']:>10.2f}"
              f" {'-' if ratio is None else f'{ratio:.2f}':>12}")  # fmt: skip
    for key, value in {**result["served_tau"], **result["draft_over_target"]}.items():
        print(f"{key}: {value:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    for f in tmp.glob("*.json"):
        f.unlink()
    tmp.rmdir()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
