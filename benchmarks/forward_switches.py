"""What two of the CPU engine's per-forward savings are worth on this host, switch by switch.

    .venv/bin/python benchmarks/forward_switches.py --json benchmarks/results/forward_switches.json

- ``eager_copy``: SGLang's eager model runner copies each forward's inputs into static buffers
  laid out for CUDA-graph replay unless ``SGLANG_EAGER_INPUT_NO_COPY`` is set (the CPU
  launcher sets it); "on" is the copy.
- ``boundaries``: upstream's ``LlamaModel.forward`` with its stage boundaries ("on") against
  the plain layer stack of ``patches/cpu_plain_llama.py``.

Both are decided at every forward, so one process alternates a switch forward by forward (ABBA)
on the same DECODE batch, with the other switch at the launcher's setting, and host drift falls
on both alike. Per switch, model (the shipped target and draft, ``--models``) and batch size,
in one process per model: the median forward time with the switch on and off, their ratio, and
whether the logits are bit-identical.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import forward_cost  # noqa: E402

SWITCH = "SGLANG_EAGER_INPUT_NO_COPY"
SWITCHES = ("eager_copy", "boundaries")


def parse_args(argv: list[str]) -> argparse.Namespace:
    return forward_cost.timing_args("forward_switches.py", argv)


def _set(runner, switch: str, on: bool) -> None:
    if switch == "eager_copy":
        os.environ[SWITCH] = "0" if on else "1"
    else:  # the plain-stack patch's cached per-model decision
        runner.model.model.__dict__["_sgl_spec_plain"] = not on


def _time_switch(runner, fb, switch: str, args: argparse.Namespace) -> dict:
    import torch

    times: dict[bool, list[float]] = {True: [], False: []}
    logits: dict[bool, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(args.warmup + args.iters):
            for on in (True, False) if i % 2 else (False, True):
                _set(runner, switch, on)
                tic = time.perf_counter()
                out = runner.forward(fb)
                elapsed = time.perf_counter() - tic
                if i >= args.warmup:
                    times[on].append(elapsed * 1e3)
                logits[on] = out.logits_output.next_token_logits.clone()
    _set(runner, switch, False)  # back to the launcher's setting
    on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
    return {"switch": switch, "on_ms": on_ms, "off_ms": off_ms, "off_over_on": off_ms / on_ms,
            "logits_identical": bool(torch.equal(logits[True], logits[False]))}  # fmt: skip


def run_worker(model_path: str, args: argparse.Namespace) -> list[dict]:
    fc_args = forward_cost.parse_args(
        ["--batch-sizes", ",".join(map(str, args.batch_sizes)), "--num-tokens", "1",
         "--ctx-len", str(args.ctx_len)]
    )  # fmt: skip
    runner = forward_cost._load_runner(model_path, fc_args)
    points = []
    for bs in args.batch_sizes:
        reqs = forward_cost.prefilled(runner, bs, args.ctx_len, 2, random.Random(0))
        fb = forward_cost.decode_after(runner, reqs, args.ctx_len)[0]
        for switch in SWITCHES:
            point = {
                "model": model_path,
                "batch_size": bs,
                **_time_switch(runner, fb, switch, args),
            }
            points.append(point)
            print(f"{Path(model_path).name} bs={bs} {switch}: on {point['on_ms']:.3f} ms, off "
                  f"{point['off_ms']:.3f} ms ({point['off_over_on']:.3f}x), logits identical "
                  f"{point['logits_identical']}", flush=True)  # fmt: skip
    return points


def main(argv: list[str]) -> dict:
    return forward_cost.per_model(str(Path(__file__).resolve()), argv, parse_args(argv), run_worker)


if __name__ == "__main__":
    main(sys.argv[1:])
