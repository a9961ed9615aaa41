"""The GPU smoke run (docs/gpu.md): every algorithm served, checked and measured, results in OUT.

    python launch/gpu/smoke.py OUT [--work DIR] [--preset 1b] [--skip-bench] [--budget-s 1400]

Steps, each recorded in ``OUT/smoke.json`` as passed / failed (with the error and the server
log's tail) / skipped, a failure never stopping the later steps:

1. ``env``: torch, CUDA devices, whether the compiled ``sgl_kernel`` or sgl-spec's PyTorch ops
   serve, package versions.
2. ``models``: random-weight models of the preset's shape (``make_models.py``).
3. ``lossless``: ``none`` serves short code prompts greedily (token ids); STANDALONE_FULL (small
   draft, and the target as its own draft), MTP_LORA (k = 2), SPECBLOCK and MINEDRAFT (own
   draft process, on the second GPU when there is one, and the identical draft) serve the same
   prompts: token ids must equal ``none``'s, and each identical draft must accept >= 95% of
   the maximum accept length.
4. ``bench_c1`` / ``bench_c16``: ``benchmarks/bench_speculative.py --interleave`` at
   concurrency 1 and 16 (ratios against ``none``, measured side by side).
5. ``gamma_tolerance``: ``benchmarks/gamma_tolerance.py`` on the target (τ(γ) of a verify).

Models and logs go to ``--work`` (a temporary folder by default); the logs are packed into
``OUT/logs.tgz`` at the end, so OUT holds at most six files (the lending tool brings back at
most 8). Exit status 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
# Short code prompts (where a draft that misses a sequence's first token loses most): the
# starts of eight stdlib functions.
PROMPTS = [f"def {name}(" for name in ("wrap", "fill", "shorten", "dedent", "indent",
           "bisect_left", "insort", "capwords")]  # fmt: skip
MIN_SHARE = 0.95  # of the maximum accept length, for an identical draft
CHAIN = "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"


class Smoke:
    def __init__(
        self, out: Path, work: Path, budget_s: float, report_name: str = "smoke.json"
    ) -> None:
        self.out, self.work, self.logs = out, work, work / "logs"
        self.report_name = report_name
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_s
        self.report: dict = {"steps": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def step(self, name: str, fn: Callable[[], dict | None], min_left_s: float = 0) -> None:
        left = self.deadline - time.monotonic()
        if left < min_left_s:
            self.report["steps"][name] = {"status": "skipped", "why": f"{left:.0f}s left"}
            self.save()
            return
        t0 = time.monotonic()
        print(f"smoke: {name} ...", flush=True)
        try:
            result = fn() or {}
            status = result.pop("status", "passed")
            entry = {"status": status, **result}
        except Exception as exc:  # one failing step must not hide the others' results
            entry = {
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}"[:4000],
                "traceback": traceback.format_exc()[-3000:],
            }
        entry["seconds"] = round(time.monotonic() - t0, 1)
        self.report["steps"][name] = entry
        print(f"smoke: {name} {entry['status']} ({entry['seconds']}s)", flush=True)
        self.save()

    def save(self) -> None:
        (self.out / self.report_name).write_text(json.dumps(self.report, indent=1) + "\n")

    def pack_logs(self) -> None:
        with tarfile.open(self.out / "logs.tgz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")


def env_report(cuda: bool) -> dict:
    import importlib.metadata as md

    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu": platform.processor() or platform.machine(),
    }
    for name in ("sglang", "sglang-kernel", "triton", "transformers", "flashinfer-python"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sgl_kernel, sgl_spec.cpu_kernels.boot as b; print(b.fallback_active())",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    info["sgl_kernel_import"] = "ok" if probe.returncode == 0 else probe.stderr[-2000:]
    info["sgl_spec_ops_serve"] = probe.stdout.strip() == "True"
    if cuda and not info["cuda_available"]:
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return info


def server_flags(cuda: bool, share: float = 0.3) -> list[str]:
    """Flags every smoke server gets: a small static share of GPU memory (a MINEDRAFT draft
    process must fit beside its target on one GPU), a capped KV pool on CPU, no warm-up."""
    quiet = ["--skip-server-warmup", "--log-level", "warning"]
    if cuda:
        return ["--mem-fraction-static", str(share), *quiet]
    return [
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
        "--mem-fraction-static",
        str(min(share, 0.25)),
        *quiet,
    ]


def serve(flags: list[str], log: Path, timeout: float = 600.0):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from server_process import ServerProcess, pick_port

    server = ServerProcess(flags, pick_port(), log)
    try:
        server.wait_ready(timeout)
    except Exception:
        server.stop()
        raise
    return server


def greedy(
    server, max_new_tokens: int, timeout: float = 900.0
) -> tuple[list[list[int]], list[float]]:
    """``PROMPTS`` as one greedy batch: each prompt's token ids and spec accept length."""
    payload = {
        "text": PROMPTS,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
    }
    resp = requests.post(server.url + "/generate", json=payload, timeout=timeout)
    resp.raise_for_status()
    out = resp.json()
    return [o["output_ids"] for o in out], [
        float(o["meta_info"].get("spec_accept_length") or 0.0) for o in out
    ]


def draft_device(cuda: bool, gpus: int) -> str:
    """MINEDRAFT's draft process: the second GPU when there is one, else beside the target;
    on CPU the last core."""
    return ("cuda:1" if gpus > 1 else "cuda:0") if cuda else "cpu:1"


def serve_greedy(flags: list[str], log: Path, tokens: int) -> tuple[list[list[int]], list[float]]:
    """Start a server, take its greedy answers to ``PROMPTS``, stop it."""
    server = serve(flags, log)
    try:
        return greedy(server, tokens)
    finally:
        server.stop()


def lossless_cases(models: dict, cuda: bool, gpus: int) -> dict[str, tuple[list[str], float]]:
    """name: (server flags, minimum mean accept length; 0 = no acceptance check)."""
    target, draft = models["target"], models["draft"]
    minedraft = [
        "--speculative-algorithm",
        "MINEDRAFT",
        "--minedraft-steps",
        "fixed",
        "--speculative-num-steps",
        "3",
        "--speculative-num-draft-tokens",
        "4",
        "--speculative-draft-device",
        draft_device(cuda, gpus),
    ]
    return {
        "standalone": (
            [
                "--speculative-algorithm",
                "STANDALONE_FULL",
                "--speculative-draft-model-path",
                draft,
                *CHAIN.split(),
            ],
            0.0,
        ),
        "standalone_identical": (
            [
                "--speculative-algorithm",
                "STANDALONE_FULL",
                "--speculative-draft-model-path",
                target,
                *CHAIN.split(),
            ],
            MIN_SHARE * 4,
        ),
        "mtp_lora": (
            [
                "--speculative-algorithm",
                "MTP_LORA",
                "--mtp-lora-path",
                models["mtp"],
                "--mtp-k",
                "2",
            ],
            0.0,
        ),
        "specblock": (
            [
                "--speculative-algorithm",
                "SPECBLOCK",
                "--specblock-drafter-path",
                models["specblock"],
            ],
            0.0,
        ),
        "minedraft": ([*minedraft, "--speculative-draft-model-path", draft], 0.0),
        "minedraft_identical": (
            [*minedraft, "--speculative-draft-model-path", target],
            MIN_SHARE * 4,
        ),
    }


def run_lossless(smoke: Smoke, models: dict, base: list[str], cuda: bool, gpus: int) -> None:
    tokens = 48
    model = ["--model-path", models["target"]]

    def baseline() -> dict:
        ids, _ = serve_greedy([*model, *base], smoke.logs / "none.log", tokens)
        smoke.report["baseline_ids"] = ids
        return {"tokens": sum(len(x) for x in ids)}

    smoke.step("lossless_none", baseline, min_left_s=120)
    expected = smoke.report.get("baseline_ids")
    for name, (flags, min_accept) in lossless_cases(models, cuda, gpus).items():

        def check(
            name: str = name, flags: list[str] = flags, min_accept: float = min_accept
        ) -> dict:
            if expected is None:
                return {"status": "skipped", "why": "no baseline"}
            ids, accept = serve_greedy([*model, *base, *flags], smoke.logs / f"{name}.log", tokens)
            mean = sum(accept) / len(accept)
            same = [a == b for a, b in zip(ids, expected, strict=True)]
            result = {
                "greedy_equal": all(same),
                "prompts_equal": sum(same),
                "mean_accept": round(mean, 3),
                "min_accept": min_accept,
            }
            if not all(same) or mean < min_accept:
                result["status"] = "failed"
            return result

        smoke.step(f"lossless_{name}", check, min_left_s=120)


def run_bench(
    smoke: Smoke, models: dict, extra: list[str], cuda: bool, gpus: int, concurrency: int
) -> dict:
    """bench_speculative with every server up at once (``--interleave``): on one GPU each gets
    a tenth of its memory."""
    name = f"bench_c{concurrency}"
    variants = {  # the built-ins name the shipped adapter / drafter: point them at ours
        "mtp_lora_r": f"mtp_lora --mtp-lora-path {models['mtp']}",
        "mtp_lora_auto_r": f"mtp_lora_auto --mtp-lora-path {models['mtp']}",
        "specblock_r": f"specblock --specblock-drafter-path {models['specblock']}",
        "minedraft_r": f"minedraft --speculative-draft-device {draft_device(cuda, gpus)}",
    }
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_speculative.py"),
        "--algorithms",
        ",".join(["none", "standalone", *variants]),
    ]
    for variant, spec in variants.items():
        cmd += ["--variant", f"{variant}={spec}"]
    cmd += [
        "--num-prompts",
        str(max(8, 2 * concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--output-len",
        "128",
        "--input-len",
        "128",
        "--interleave",
        "--rounds",
        "2",
        "--json",
        str(smoke.out / f"{name}.json"),
        "--log-dir",
        str(smoke.logs / name),
        "--model-path",
        models["target"],
        "--speculative-draft-model-path",
        models["draft"],
        *server_flags(cuda, share=0.1),
        *extra,
    ]
    log = smoke.logs / f"{name}.out"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1500)
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_speculative exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        )
    return {"summary": log.read_text()[-2500:]}


def run_gamma(smoke: Smoke, models: dict, cuda: bool) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gamma_tolerance.py"),
        "--model-path",
        models["target"],
        "--json",
        str(smoke.out / "gamma_tolerance.json"),
        "--plot",
        str(smoke.logs / "gamma_tolerance.png"),
    ]
    if cuda:
        cmd += [
            "--dtype",
            "bfloat16",
            "--device",
            "cuda",
            "--batch-sizes",
            "1,8,32,128",
            "--ctx-lens",
            "512,2048",
        ]
    else:
        cmd += ["--batch-sizes", "1,4", "--ctx-lens", "128", "--gammas", "1,2,4", "--iters", "3"]
    log = smoke.logs / "gamma_tolerance.out"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"gamma_tolerance exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    return {"summary": log.read_text()[-2000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path, default=None, help="models and logs (default: tmp)")
    parser.add_argument(
        "--preset", default=None, help="make_models preset (default: 1b on CUDA, tiny on CPU)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=1400.0,
        help="steps that would start with less than their need left are skipped",
    )
    parser.add_argument("--extra", default="", help="server flags added to every server")
    args = parser.parse_args(argv)
    import torch

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    preset = args.preset or ("1b" if cuda else "tiny")
    work = args.work or Path(tempfile.mkdtemp(prefix="sglspec-smoke-"))
    smoke = Smoke(args.out, work, args.budget_s)
    smoke.report.update(device="cuda" if cuda else "cpu", gpus=gpus, preset=preset)
    smoke.step("env", lambda: {"info": env_report(cuda)})
    extra = args.extra.split()
    base = server_flags(cuda) + extra

    def models_step() -> dict:
        sys.path.insert(0, str(ROOT / "launch" / "gpu"))
        import make_models

        info = make_models.build(
            work / "models",
            preset,
            "cuda" if cuda else "cpu",
            max(1, make_models.PRESETS[preset][1] // 8),
            40.0,
            0,
        )
        smoke.report["models"] = info
        return {"info": info}

    smoke.step("models", models_step)
    models = smoke.report.get("models")
    if models is None:
        smoke.pack_logs()
        return 1
    run_lossless(smoke, models, base, cuda, gpus)
    if not args.skip_bench:
        for conc in (1, 16):
            smoke.step(
                f"bench_c{conc}",
                lambda c=conc: run_bench(smoke, models, extra, cuda, gpus, c),
                min_left_s=300,
            )
    smoke.step("gamma_tolerance", lambda: run_gamma(smoke, models, cuda), min_left_s=120)
    smoke.report.pop("baseline_ids", None)
    smoke.report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    smoke.save()
    smoke.pack_logs()
    failed = [k for k, v in smoke.report["steps"].items() if v["status"] != "passed"]
    print(f"smoke: {'all passed' if not failed else 'not passed: ' + ', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
