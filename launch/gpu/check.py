"""The short GPU device check (docs/gpu.md): one command of at most 7 minutes, results in OUT.

    python launch/gpu/check.py OUT [--device cuda|cpu] [--budget-s 360]

Every step is written to ``OUT/check.json`` as it ends (passed / failed with the error /
skipped when the budget ran out), so a run killed at its limit still returns what it finished:

1. ``env``: devices, driver, torch, CUDA, nvcc, package versions, whether sgl-spec's PyTorch
   ops stand in for ``sgl_kernel`` and serve ``weak_ref_tensor`` (CUDA-graph capture).
2. ``models``: random-weight Llama models (``make_models.py``) of the ``lossless`` preset (1b
   on CUDA), and in the background those of the ``bench`` preset (8b on CUDA: hidden 4096, 32
   layers, 32/8 heads, bf16), each with a draft made of the target's first 2 layers.
3. ``lossless``: servers of every algorithm started side by side, the target greedy-decoding
   short prompts in float32 with Triton's fp32 dots in IEEE precision (so that kernel-shape
   rounding cannot flip a random model's argmax): token ids equal to ``none``'s; on
   fixed-length requests, each server's wall time per forward step at concurrency 1, and an
   identical draft (the target itself) accepting >= 95% of the bound (``accept_bound``) for
   STANDALONE_FULL and MINEDRAFT. On CUDA ``none`` and STANDALONE_FULL run with CUDA graphs and
   eager (``*_eager``), so the graphs' gain is measured and their outputs checked; MINEDRAFT's
   draft runs on the second GPU, or on the CPU where there is one GPU.
4. ``bench``: the bench preset's servers side by side (``none`` eager and with graphs,
   STANDALONE_FULL / MINEDRAFT (two GPUs only) with the identical draft, MTP_LORA k = 2,
   SPECBLOCK), rounds of concurrency 1 and 16 in ABBA order after an untimed warm-up pass:
   throughput ratio to ``none``, accept length, wall time per step, greedy equality with
   ``none``; then, while the budget lasts, SGLang's torch profiler over 8 steps at concurrency
   1 of STANDALONE_FULL (with Python stacks), ``none``, MTP_LORA and SPECBLOCK
   (``profile_step.py``): where each step's time goes, the traces beside check.json.

On CPU (``--device cpu``, the dry run) both presets are ``tiny`` and no eager twins run.
Exit status 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "benchmarks")]

from server_process import ServerProcess, pick_port  # noqa: E402
from smoke import MIN_SHARE, Smoke, env_report, greedy  # noqa: E402

DRAFT_LAYERS = 2
DRAFT_TOKENS = 4  # per verify: 3 draft steps in a chain
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", str(DRAFT_TOKENS)]  # fmt: skip
EAGER = ["--disable-cuda-graph"]
BENCH_TOKENS = 64
WARM_TOKENS = 16
ACCEPT_TOKENS = 48  # per request (ignore_eos) when an identical draft's acceptance is judged
ROUNDS = 2
# (server, with Python stacks): profiled in this order while the budget lasts; 3 traces at most
# come back (the device returns 8 files)
PROFILED = (
    ("standalone_identical", True),
    ("none", False),
    ("mtp_lora", False),
    ("specblock", False),
)
PROFILE_STEPS = 8


def server_flags(cuda: bool) -> list[str]:
    """Flags of every check server: a high static share with a small, capped KV pool, so that
    servers started together each size their pool from what the others leave; idle servers
    sleep instead of polling, so they do not slow the one being measured."""
    flags = ["--mem-fraction-static", "0.88", "--max-total-tokens", "4096",
             "--max-running-requests", "32", "--sleep-on-idle", "--skip-server-warmup",
             "--log-level", "warning"]  # fmt: skip
    if cuda:
        # decode graphs only: the step times are decode steps, and capturing prefill graphs
        # took a minute per server when nine start together (H200, 2026-11-27)
        return [*flags, "--chunked-prefill-size", "2048", "--cuda-graph-max-bs-decode", "16",
                "--disable-prefill-cuda-graph"]  # fmt: skip
    return [*flags, "--dtype", "float32"]


def variants(
    models: dict, cuda: bool, bench: bool, graphs_failed: frozenset[str] = frozenset()
) -> dict[str, tuple[list[str], float]]:
    """name: (algorithm flags, share of the accept bound an identical draft must reach; 0 = not
    checked). In the bench, a server whose CUDA-graph twin failed in the lossless step runs
    eager in its place."""
    target, draft = models["target"], models["draft"]
    # MINEDRAFT drafts on a device of its own: the second GPU; on a one-GPU machine the CPU
    # for the lossless check, and no bench (its point, a draft beside the target, is lost)
    md_device = ["--speculative-draft-device", "cuda:1" if _gpus() > 1 else "cpu"]
    if not cuda:
        md_device = ["--speculative-draft-device", "cpu:1"]
    # every draft verified (not the controller's choice): the identical draft's acceptance is
    # the engine's upper bound, and the bench compares fixed chains
    minedraft = ["--speculative-algorithm", "MINEDRAFT", "--minedraft-steps", "fixed",
                 "--speculative-num-steps", "3", "--speculative-num-draft-tokens",
                 str(DRAFT_TOKENS), *md_device]  # fmt: skip
    standalone = [
        "--speculative-algorithm",
        "STANDALONE_FULL",
        "--standalone-steps",
        "fixed",
        *CHAIN,
    ]
    out: dict[str, tuple[list[str], float]] = {"none": ([], 0.0)}
    if cuda:
        out["none_eager"] = (EAGER, 0.0)
    if not bench:
        out["standalone"] = ([*standalone, "--speculative-draft-model-path", draft], 0.0)
    out["standalone_identical"] = (
        [*standalone, "--speculative-draft-model-path", target],
        MIN_SHARE,
    )
    if cuda and not bench:
        out["standalone_identical_eager"] = (
            [*standalone, "--speculative-draft-model-path", target, *EAGER],
            MIN_SHARE,
        )
    out["mtp_lora"] = (
        ["--speculative-algorithm", "MTP_LORA", "--mtp-lora-path", models["mtp"], "--mtp-k", "2"],
        0.0,
    )
    out["specblock"] = (
        ["--speculative-algorithm", "SPECBLOCK", "--specblock-drafter-path", models["specblock"]],
        0.0,
    )
    if not bench:
        out["minedraft"] = ([*minedraft, "--speculative-draft-model-path", draft], 0.0)
    if not (bench and cuda and _gpus() < 2):
        out["minedraft_identical"] = (
            [*minedraft, "--speculative-draft-model-path", target],
            MIN_SHARE,
        )
    if bench and cuda:
        for name in graphs_failed & set(out):
            flags, least = out.pop(name)
            if f"{name}_eager" not in out:
                out[f"{name}_eager"] = ([*flags, *EAGER], least)
    return out


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def start_fleet(
    flags: dict[str, list[str]], logs: Path, timeout: float
) -> tuple[dict[str, ServerProcess], dict[str, str]]:
    """Start every server at once; wait for all. Returns (ready servers, name: start error)."""
    procs = {name: ServerProcess(f, pick_port(), logs / f"{name}.log") for name, f in flags.items()}

    def wait(item: tuple[str, ServerProcess]) -> str | None:
        try:
            item[1].wait_ready(timeout)
        except Exception as exc:  # recorded per server; the others go on
            item[1].stop()
            return f"{type(exc).__name__}: {exc}"[:3000]
        return None

    with ThreadPoolExecutor(len(procs)) as pool:
        errors = dict(zip(procs, pool.map(wait, procs.items()), strict=True))
    ready = {n: p for n, p in procs.items() if errors[n] is None}
    return ready, {n: e for n, e in errors.items() if e is not None}


def stop_fleet(servers: dict[str, ServerProcess]) -> None:
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(lambda s: s.stop(), servers.values()))


def bench_prompts(count: int) -> list[str]:
    """Distinct code prompts of ~100 tokens (slices of a stdlib module's source)."""
    import textwrap

    source = Path(textwrap.__file__).read_text()
    return [source[400 * i : 400 * i + 400] for i in range(count)]


def generate(server: ServerProcess, prompt: str, tokens: int) -> dict:
    payload = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
    }
    resp = requests.post(server.url + "/generate", json=payload, timeout=180)
    resp.raise_for_status()
    return resp.json()


def measure(server: ServerProcess, prompts: list[str], concurrency: int, tokens: int) -> dict:
    """Serve ``prompts`` at ``concurrency``: throughput, accept length and wall time per
    forward step (a request's steps: its verify count, or its tokens without speculation;
    the prefill is counted in)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: generate(server, p, tokens), prompts))
    wall = time.perf_counter() - t0
    produced = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = sum(int(o["meta_info"].get("spec_verify_ct") or 0) or
                o["meta_info"]["completion_tokens"] for o in outs)  # fmt: skip
    return {
        "wall_s": wall,
        "tokens": produced,
        "tok_per_s": produced / wall,
        "accept": produced / steps,
        # at concurrency 1 the steps run one after another; above, they overlap
        "step_ms": 1000 * wall / steps * concurrency,
        "ids": [o["output_ids"] for o in outs],
    }


def greedy_check(servers: dict[str, ServerProcess], tokens: int) -> dict:
    """Each server's greedy ids for ``PROMPTS`` (one batch) against the baseline's."""

    def run(item: tuple[str, ServerProcess]) -> tuple[str, dict]:
        try:
            ids, accept = greedy(item[1], tokens, timeout=180)
        except Exception as exc:
            return item[0], {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        return item[0], {"ids": ids, "mean_accept": round(sum(accept) / len(accept), 3)}

    with ThreadPoolExecutor(len(servers)) as pool:
        results = dict(pool.map(run, servers.items()))
    base_name = next((n for n in ("none", "none_eager") if "ids" in results.get(n, {})), None)
    report = {"baseline": base_name}
    for name, res in results.items():
        if "ids" not in res or base_name is None:
            report[name] = {"status": "failed", **res}
            continue
        same = [a == b for a, b in zip(res["ids"], results[base_name]["ids"], strict=True)]
        report[name] = {"status": "passed" if all(same) else "failed", "greedy_equal": all(same),
                        "prompts_equal": sum(same), "mean_accept": res["mean_accept"]}  # fmt: skip
    return report


def accept_bound(tokens: int, draft_tokens: int = DRAFT_TOKENS) -> float:
    """Most tokens per verify a request of ``tokens`` can show: the prefill gives the first,
    each verify at most ``draft_tokens``, and an overlap scheduler may run one verify more
    whose tokens the finished request drops (SGLang's STANDALONE on CUDA)."""
    return tokens / (-(-(tokens - 1) // draft_tokens) + 1)


def judge_accept(case: dict, step: dict, share: float) -> None:
    """Fail ``case`` when its identical draft (``share`` > 0) accepted under ``share`` of the
    bound, measured on the fixed-length requests of ``step_times``."""
    if share <= 0 or case.get("status") != "passed":
        return
    need = share * accept_bound(ACCEPT_TOKENS)
    case.update(accept_fixed_length=step.get("accept"), min_accept=round(need, 3))
    if step.get("accept") is None or step["accept"] < need:
        case["status"] = "failed"


def step_times(servers: dict[str, ServerProcess], prompts: list[str], tokens: int) -> dict:
    """Wall time per step at concurrency 1, one server after another."""
    out = {}
    for name, server in servers.items():
        try:
            generate(server, prompts[0], tokens)  # warm-up: Triton compiles at first use
            res = measure(server, prompts, 1, tokens)
            out[name] = {"step_ms": round(res["step_ms"], 2), "accept": round(res["accept"], 3)}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    return out


def rounds(
    check: Smoke, servers: dict[str, ServerProcess], concurrency: int, prompts: list[str]
) -> dict:
    """ABBA rounds at one concurrency: every server per round, the order reversed each round;
    throughput ratio to ``none`` from the summed rounds."""
    runs: dict[str, list[dict]] = {n: [] for n in servers}
    errors = warm_up(servers, prompts, concurrency)
    order = list(servers)
    for r in range(ROUNDS):
        if check.deadline - time.monotonic() < 20 and r > 0:
            break
        for name in order if r % 2 == 0 else order[::-1]:
            if name in errors:
                continue
            try:
                runs[name].append(measure(servers[name], prompts, concurrency, BENCH_TOKENS))
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"[:1000]
    summary = {}
    base = runs.get("none") or runs.get("none_eager") or []
    base_rate = sum(x["tokens"] for x in base) / sum(x["wall_s"] for x in base) if base else None
    for name, res in runs.items():
        if not res:
            summary[name] = {"error": errors.get(name, "no round ran")}
            continue
        rate = sum(x["tokens"] for x in res) / sum(x["wall_s"] for x in res)
        same = [a == b for a, b in zip(res[0]["ids"], base[0]["ids"], strict=True)] if base else []
        summary[name] = {
            "tok_per_s": round(rate, 1),
            "ratio_to_none": round(rate / base_rate, 3) if base_rate else None,
            "accept": round(sum(x["accept"] for x in res) / len(res), 3),
            "step_ms": round(sum(x["step_ms"] for x in res) / len(res), 2),
            "rounds": len(res),
            "greedy_equal_none": all(same) if same else None,
        }
        if name in errors:
            summary[name]["error"] = errors[name]
    return summary


def profiles(
    check: Smoke, servers: dict[str, ServerProcess], cuda: bool, step: str = "bench"
) -> dict:
    """SGLang's torch profiler over ``PROFILE_STEPS`` decode steps of each of ``PROFILED`` at
    concurrency 1 (``profile_step.py``), while the budget lasts: the trace's summary, and the
    trace itself beside check.json where it is small enough to come back."""
    import shutil

    from profile_step import profile_server, summarize

    out: dict = {}
    for name, with_stack in PROFILED:
        if name not in servers or check.deadline - time.monotonic() < 30:
            out[name] = {"skipped": "not running" if name not in servers else "budget"}
            continue
        server = servers[name]
        try:
            trace = profile_server(
                server.url,
                check.logs / "profile" / name,
                lambda s=server: generate(s, bench_prompts(1)[0], BENCH_TOKENS),
                PROFILE_STEPS,
                with_stack,
                cuda,
                timeout_s=min(60.0, check.deadline - time.monotonic() - 5),
            )
            out[name] = summarize(trace, PROFILE_STEPS)
            if trace.stat().st_size < 6 << 20 and len(list(check.out.glob("trace_*"))) < 3:
                shutil.move(trace, check.out / f"trace_{name}.json.gz")
            else:
                trace.unlink()
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        check.report["steps"].setdefault(step, {"status": "running"})["profile"] = out
        check.save()
    return out


def warm_up(servers: dict[str, ServerProcess], prompts: list[str], concurrency: int) -> dict:
    """A short untimed pass of ``prompts`` on every server at once: Triton compiles a kernel
    for each new specialisation at first use, 18-20 s each on a busy host (seen on an H200),
    which a timed round must not include. Returns name: error for servers that failed."""

    def run(item: tuple[str, ServerProcess]) -> tuple[str, str | None]:
        try:
            measure(item[1], prompts, concurrency, WARM_TOKENS)
        except Exception as exc:
            return item[0], f"{type(exc).__name__}: {exc}"[:1000]
        return item[0], None

    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        return {n: e for n, e in pool.map(run, servers.items()) if e is not None}


def env_info(cuda: bool) -> dict:
    """``smoke.env_report`` plus the driver, nvcc, and whether ``weak_ref_tensor`` is served."""
    info = env_report(cuda)
    probes = {
        "driver": ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                   "--format=csv,noheader"],
        "nvcc": ["nvcc", "--version"],
        "weak_ref_tensor": [sys.executable, "-c", "import torch, sgl_kernel; "
                            "print(hasattr(torch.ops.sgl_kernel, 'weak_ref_tensor'))"],
    }  # fmt: skip
    for name, cmd in probes.items():
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            info[name] = (proc.stdout.strip() or proc.stderr.strip())[-600:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            info[name] = f"{type(exc).__name__}: {exc}"
    return info


def make_models(work: Path, preset: str, device: str) -> dict:
    import make_models as mm

    return mm.build(work, preset, device, DRAFT_LAYERS, 40.0, 0)


def start_bench_models(work: Path, preset: str, device: str, log: Path) -> subprocess.Popen:
    """``make_models.py`` in a child process, while the lossless servers run."""
    cmd = [sys.executable, str(HERE / "make_models.py"), str(work), "--preset", preset,
           "--device", device, "--draft-layers", str(DRAFT_LAYERS)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--work", type=Path, default=None, help="models and logs (default: tmp)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="for everything below")
    parser.add_argument("--lossless-preset", default=None, help="default: 1b on CUDA, tiny on CPU")
    parser.add_argument("--bench-preset", default=None, help="default: 8b on CUDA, tiny on CPU")
    parser.add_argument(
        "--cases", default=None, help="comma list: the lossless servers to run (none always)"
    )
    parser.add_argument(
        "--no-bench",
        action="store_true",
        help="no bench preset: profile the lossless servers instead (a short device budget)",
    )
    args = parser.parse_args(argv)
    only = {"none", *args.cases.split(",")} if args.cases else None
    import torch

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    device = "cuda" if cuda else "cpu"
    lossless_preset = args.lossless_preset or ("1b" if cuda else "tiny")
    bench_preset = args.bench_preset or ("8b" if cuda else "tiny")
    if args.no_bench:
        bench_preset = lossless_preset
    work = args.work or Path(tempfile.mkdtemp(prefix="sglspec-check-"))
    check = Smoke(args.out, work, args.budget_s, report_name="check.json")
    check.report.update(device=device, gpus=_gpus(), presets=[lossless_preset, bench_preset])
    base = server_flags(cuda)
    check.step("env", lambda: {"info": env_info(cuda)})

    def lossless_models() -> dict:
        check.report["models"] = make_models(work / "lossless", lossless_preset, device)
        return {"info": check.report["models"]}

    check.step("models", lossless_models)
    bench_job = None
    if lossless_preset != bench_preset and not args.no_bench:
        bench_job = start_bench_models(
            work / "bench", bench_preset, device, check.logs / "models.log"
        )
    models = check.report.get("models")
    fleet: dict[str, ServerProcess] = {}

    def lossless() -> dict:
        cases = variants(models, cuda, bench=False)
        if only is not None and only - set(cases):
            raise ValueError(
                f"--cases: no such server {sorted(only - set(cases))}: {sorted(cases)}"
            )
        cases = {n: v for n, v in cases.items() if only is None or n in only}
        # float32: in bf16 a random model's argmax flips with the kernels' shapes (decode vs
        # verify), which would hide what this checks, the algorithms' losslessness
        fp32 = ["--dtype", "float32"] if cuda else []
        flags = {
            n: ["--model-path", models["target"], *base, *fp32, *f] for n, (f, _) in cases.items()
        }
        # Triton's fp32 dot defaults to TF32 on NVIDIA: decode and verify attention then round
        # differently enough to flip a random model's argmax (seen on an H200)
        before = os.environ.get("TRITON_F32_DEFAULT")
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        try:
            fleet.update(start_fleet(flags, check.logs, timeout=200 if cuda else 300)[0])
        finally:
            if before is None:
                os.environ.pop("TRITON_F32_DEFAULT")
            else:
                os.environ["TRITON_F32_DEFAULT"] = before
        started = set(fleet)
        report = greedy_check(fleet, 48)
        for name in cases:
            if name not in started:
                report[name] = {"status": "failed", "error": "start-up failed (see its log)"}
        report["step_c1"] = step_times(fleet, bench_prompts(2), ACCEPT_TOKENS)
        for name, (_, share) in cases.items():
            judge_accept(report[name], report["step_c1"].get(name, {}), share)
        failed = [n for n in cases if report[n]["status"] != "passed"]
        return {"status": "failed" if failed else "passed", "cases": report, "failed": failed}

    # one preset for both phases (the CPU dry run): the bench reuses the lossless servers
    reuse = lossless_preset == bench_preset and not args.no_bench
    try:
        if models is not None:
            check.step("lossless", lossless, min_left_s=150)
        if args.no_bench and fleet:
            check.step(
                "profile",
                lambda: {"profile": profiles(check, fleet, cuda, "profile")},
                min_left_s=30,
            )
    finally:
        if not reuse:
            stop_fleet(fleet)
            fleet.clear()
        check.pack_logs()

    def bench() -> dict:
        if reuse:
            info = models
            cases = variants(info, cuda, bench=True)
            errors = {n: "not started in the lossless step" for n in cases if n not in fleet}
            for name in set(fleet) - set(cases):
                fleet.pop(name).stop()
        else:
            if bench_job.wait(timeout=max(1.0, check.deadline - time.monotonic())) != 0:
                raise RuntimeError((check.logs / "models.log").read_text()[-3000:])
            info = json.loads((work / "bench" / "models.json").read_text())
            lossless_cases = check.report["steps"].get("lossless", {}).get("cases", {})
            failed = frozenset(
                name for name in ("none", "standalone_identical")
                if lossless_cases.get(name, {}).get("status") == "failed"
                and lossless_cases.get(f"{name}_eager", {}).get("status") == "passed"
            )  # fmt: skip
            cases = variants(info, cuda, bench=True, graphs_failed=failed)
            flags = {n: ["--model-path", info["target"], *base, *f] for n, (f, _) in cases.items()}
            left = check.deadline - time.monotonic()
            ready, errors = start_fleet(flags, check.logs / "bench", timeout=min(300, left - 60))
            fleet.update(ready)
        check.report["bench_models"] = info
        result: dict = {"start_errors": errors}
        for conc, count in ((1, 3), (16, 16)):
            if check.deadline - time.monotonic() < 15:
                result[f"c{conc}"] = {"skipped": "budget"}
                continue
            result[f"c{conc}"] = rounds(check, fleet, conc, bench_prompts(count))
            check.report["steps"]["bench"] = {"status": "running", **result}
            check.save()
        result["profile"] = profiles(check, fleet, cuda)
        return {"status": "failed" if errors else "passed", **result}

    (check.logs / "bench").mkdir(exist_ok=True)
    try:
        if models is not None and not args.no_bench:
            check.step("bench", bench, min_left_s=40 if reuse else 120)
    finally:
        stop_fleet(fleet)
        if bench_job is not None and bench_job.poll() is None:
            bench_job.kill()
    check.report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    check.save()
    check.pack_logs()
    failed = [k for k, v in check.report["steps"].items() if v["status"] != "passed"]
    print(f"check: {'all passed' if not failed else 'not passed: ' + ', '.join(failed)}")
    print(json.dumps(summary_table(check.report), indent=1))
    return 0 if not failed else 1


def summary_table(report: dict) -> dict:
    """What the reply's tail should show: each step's status and the ratios."""
    steps = report["steps"]
    out = {name: step.get("status") for name, step in steps.items()}
    cases = steps.get("lossless", {}).get("cases", {})
    out["lossless"] = {n: (c.get("greedy_equal"), c.get("mean_accept")) for n, c in cases.items()
                       if isinstance(c, dict) and "status" in c}  # fmt: skip
    out["step_c1"] = cases.get("step_c1")
    for conc in ("c1", "c16"):
        res = steps.get("bench", {}).get(conc, {})
        out[conc] = {n: (r.get("ratio_to_none"), r.get("accept"), r.get("step_ms"))
                     for n, r in res.items() if isinstance(r, dict)}  # fmt: skip
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
