"""Hugging Face transformers peer of ``bench_speculative.py``: ``generate`` on the same target.

Two ``--algorithms`` names start no server and run this module instead:

* ``hf``: ``model.generate`` on the run's target (``--model-path``, default the shipped
  ``sgl-spec/tiny-code``), greedy (``do_sample=False``), batch 1.
* ``hf-assisted``: the same with ``assistant_model=`` the run's draft
  (``--speculative-draft-model-path``, default the shipped ``sgl-spec/tiny-code-draft-narrow``):
  transformers' assisted generation with its default settings (read from the draft's
  generation config and transformers' defaults, recorded under ``peer.assistant``; in 5.19:
  20 draft tokens, ``constant`` schedule, confidence threshold 0.4, which adapts only when
  scikit-learn is installed).

Each measurement runs ``hf_peer_worker.py SPEC.json OUT.json`` in a fresh process:
fp32, ``torch.no_grad``, on the CPU (CUDA where the host has it, untested), with the torch
thread count SGLang's CPU server uses (one thread per core of ``SGLANG_CPU_OMP_THREADS_BIND``
or, unset, per core of the process's affinity: on a one-NUMA-node host that is what the server
binds), and with the launcher's malloc settings (``CPU_MALLOC_ENV``). The workload is
bench_serving's own: its ``random-ids`` sampler (with ``--prompts code`` its ``custom`` loader
on the run's file of code windows) with its seed, the text tokenized as the server tokenizes
it, ``--num-prompts`` requests of ``--output-len`` new tokens sent one after another after one
warm-up request (bench_serving's warm-up). Every request generates exactly ``--output-len``
tokens: ``eos_token_id=None`` neither stops at nor masks EOS, which is what
bench_serving's ``ignore_eos`` does on the server (``min_new_tokens`` would mask EOS logits and
change the greedy ids wherever EOS is the argmax). Then the benchmark's fixed greedy prompts,
one at a time, give the ids for the table's ``greedy=`` column.

Batch 1 always: it compares with bench_serving at ``--max-concurrency 1``; at a higher
concurrency the run's ``peer.batch_size`` stays 1 and the printed comparison says so. fp32
whatever ``--dtype`` the servers get. Not the same as the servers: no HTTP, tokenizer or
scheduler in the timed path (in HF's favour), and no prefix cache (the server prefills only one
token of the first request, whose prompt the warm-up sent; HF prefills it again).

On a shared host, another process's threads on the same cores stall multi-row matrix products
(prefill, HF's verify of the draft, the servers' verify) far more than one-row decode steps:
take the peers' numbers, like the servers', from ``--interleave --rounds R`` runs.

Metrics, with bench_serving's names and definitions where they exist:

* ``output_throughput``: generated tokens / wall time of the request loop (the warm-up excluded).
* ``mean_e2e_latency_ms``, ``p99_e2e_latency_ms``: wall time of each ``generate`` call (linear
  percentile, as numpy's); no HTTP, tokenizer or scheduler in it, unlike the servers'.
* ``mean_ttft_ms``: time to the first generated token, taken by a streamer when ``generate``
  hands it over (assisted: the first verify's tokens, possibly several).
* ``mean_tpot_ms``: ``(e2e - ttft) / (tokens - 1)`` per request, averaged (bench_serving's).
* ``mean_accept_length`` (``hf-assisted``): generated tokens / target forwards; each assisted
  iteration is one target forward over the draft tokens (accepted drafts + the bonus token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _bench_lib import BENCH_SERVING_FIXED, model_path, paired_ratio, round_seed
from server_process import tail

from sgl_spec.argv import flag_value

ASSISTED = {"hf": False, "hf-assisted": True}  # --algorithms name -> assistant_model= draft
DRAFT_FLAG = "--speculative-draft-model-path"


def peer_spec(
    name: str, args: argparse.Namespace, extra: list[str], greedy: list[list[int]], greedy_new: int
) -> dict:
    """What the worker needs: resolved model directories and the bench_serving workload."""
    from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model_path

    draft = None
    if ASSISTED[name]:
        draft = resolve_model_path(flag_value(extra, DRAFT_FLAG) or DEFAULT_DRAFT)
    return {
        "target": resolve_model_path(model_path(extra) or DEFAULT_TARGET),
        "draft": draft,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": round_seed(args),
        "range_ratio": float(flag_value(BENCH_SERVING_FIXED, "--random-range-ratio")),
        "greedy_prompts": greedy,
        "dataset_path": None
        if getattr(args, "dataset_path", None) is None
        else str(args.dataset_path),
        "greedy_new_tokens": greedy_new,
    }


def worker_argv(spec_path: Path, out_path: Path) -> list[str]:
    worker = Path(__file__).resolve().with_name("hf_peer_worker.py")
    return [sys.executable, str(worker), str(spec_path), str(out_path)]


def run_worker_process(spec: dict, work: Path, timeout: float) -> dict:
    """Run one measurement in a fresh process; its parsed result, or raise with the log tail."""
    from sgl_spec.launch_server import CPU_MALLOC_ENV

    spec_path, out_path, log_path = work / "spec.json", work / "result.json", work / "hf_peer.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {**CPU_MALLOC_ENV, **os.environ}  # the server's malloc settings, unless set already
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                worker_argv(spec_path, out_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"worker timed out after {timeout:.0f}s (log {log_path})") from exc
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(
            f"worker failed with code {proc.returncode} (log {log_path}):\n{tail(log_path)}"
        )
    return parse_peer_result(out_path.read_text(), spec["num_prompts"], spec["output_len"])


def measure_peer(
    name: str,
    args: argparse.Namespace,
    extra: list[str],
    work: Path,
    greedy: list[list[int]],
    greedy_new: int,
) -> dict:
    """One measurement of peer ``name``; any failure becomes ``run["error"]``."""
    run: dict = {"algorithm": name, "log_dir": str(work)}
    work.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] transformers generate in a fresh process (logs {work})", flush=True)
    try:
        run.update(run_worker_process(peer_spec(name, args, extra, greedy, greedy_new), work,
                                      args.timeout))  # fmt: skip
        run["peer"]["server_max_concurrency"] = args.max_concurrency
    except Exception as exc:
        run["error"] = f"hf peer: {type(exc).__name__}: {exc}"
        print(f"[{name}] FAILED: {run['error']}", file=sys.stderr, flush=True)
    return run


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), as bench_serving reports p99."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def request_metrics(requests: list[dict], duration_s: float) -> dict:
    """bench_serving's metrics from per-request ``e2e_s``, ``ttft_s``, ``output_tokens``."""
    e2e = [r["e2e_s"] for r in requests]
    tpots = [
        (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
        for r in requests
        if r["output_tokens"] > 1
    ]
    return {
        "output_throughput": sum(r["output_tokens"] for r in requests) / duration_s,
        "mean_e2e_latency_ms": statistics.mean(e2e) * 1e3,
        "p99_e2e_latency_ms": percentile(e2e, 99) * 1e3,
        "mean_ttft_ms": statistics.mean(r["ttft_s"] for r in requests) * 1e3,
        "mean_tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
    }


def parse_peer_result(text: str, num_prompts: int, output_len: int) -> dict:
    """A run's fields from the worker's result file; refuses a short or incomplete run."""
    result = json.loads(text)
    requests = result["requests"]
    if len(requests) != num_prompts:
        raise ValueError(f"the worker completed {len(requests)}/{num_prompts} requests")
    short = [r["output_tokens"] for r in requests if r["output_tokens"] != output_len]
    if short:
        raise ValueError(f"requests generated {short} tokens, not {output_len}")
    run = request_metrics(requests, result["duration_s"])
    tokens = sum(r["output_tokens"] for r in requests)
    assisted = result["peer"]["assistant"] is not None
    run["mean_accept_length"] = tokens / result["target_forwards"] if assisted else None
    run["accept_length_source"] = "target_forwards" if assisted else None
    run["greedy_output_ids"] = result["greedy_output_ids"]
    run["peer"] = {
        **result["peer"],
        "input_tokens": sum(r["input_tokens"] for r in requests),
        "target_forwards": result["target_forwards"],
        "draft_forwards": result["draft_forwards"],
    }
    return run


def combine_peer_rounds(combined: dict, rounds: list[dict]) -> dict:
    """``combine_rounds`` keeps the shared metrics: add the peer's description and TTFT."""
    if "error" in combined or "peer" not in rounds[0] or len(rounds) == 1:
        return combined
    combined["peer"] = rounds[0]["peer"]
    combined["mean_ttft_ms"] = statistics.median(r["mean_ttft_ms"] for r in rounds)
    return combined


def peer_comparison(runs: list[dict]) -> list[dict]:
    """Per successful peer: the fastest server run and ``its tok/s / the peer's``; with rounds
    also the median over rounds of each round's ratio (``paired``)."""
    servers = [r for r in runs if "peer" not in r and "error" not in r]
    if not servers:
        return []
    best = max(servers, key=lambda r: r["output_throughput"])
    out = []
    for peer in (r for r in runs if "peer" in r and "error" not in r):
        out.append(
            {
                "peer": peer["algorithm"],
                "peer_output_throughput": peer["output_throughput"],
                "best_server": best["algorithm"],
                "best_output_throughput": best["output_throughput"],
                "ratio": best["output_throughput"] / peer["output_throughput"],
                "ratio_paired": paired_ratio(
                    best.get("rounds"), peer.get("rounds"), "output_throughput"
                ),
                "server_max_concurrency": peer["peer"]["server_max_concurrency"],
                "peer_batch_size": peer["peer"]["batch_size"],
            }
        )
    return out


def format_comparison(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        paired = row["ratio_paired"]
        line = (
            f"{row['best_server']} {row['best_output_throughput']:.2f} tok/s vs {row['peer']} "
            f"{row['peer_output_throughput']:.2f} tok/s: {row['ratio']:.3f}x"
            + (f" (paired {paired:.3f}x)" if paired is not None else "")
        )
        if row["server_max_concurrency"] != 1:
            line += (
                f" [servers at --max-concurrency {row['server_max_concurrency']}, "
                f"{row['peer']} at batch {row['peer_batch_size']}: not the concurrency-1 setting]"
            )
        lines.append(line)
    return lines
