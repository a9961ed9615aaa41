"""Predicted speedup from measured forward costs and acceptance, next to the measured one.

    .venv/bin/python benchmarks/cost_model.py \\
        --forward-cost benchmarks/results/forward_cost_s16.json \\
        --bench benchmarks/results/spec_pays_s16_c1.json

A speculative step at batch 1 costs the target and draft forwards it runs; between them a
served step adds scheduling, tree and sampling work that this model leaves out, so the
prediction is an upper bound on what the engine can give at that acceptance. Per step:

- ``none``: one target forward of 1 token per token;
- ``standalone-fixed``, ``standalone_sglang`` (a fixed chain of ``s`` steps, SGLang's default
  3; ``standalone``, the chain length chosen per step, has no row): the target verifies ``s + 1``
  tokens, the draft runs ``s - 1`` one-token decodes and one extend of ``s + 2`` tokens (the
  accepted tokens and the bonus, ``standalone_full_context``);
- ``mtp_lora`` (``k`` drafts): one target forward of ``(k + 1)²`` tokens (anchors and masks):
  the gated tree verify itself where ``forward_cost.py --mtp-adapter`` timed it for that k
  (its mask rows on the LoRA path, the layout's tree mask), else a plain chain verify of that
  width (the model's form before the gated step was measured; ``priced_as`` says which);
- ``specblock-fixed`` (``n`` tree nodes every step; ``specblock`` in runs before SPECBLOCK's
  default became the controller, 2026-12-02): a target verify of ``n`` tokens plus the drafter,
  whose share of the step (T_D%) the server measures, so that row is part measured.

The measured step, in target decodes, follows from the measured speedup and acceptance
(speedup = acceptance x T(1) / step); its excess over the forward-cost step is the served
step's work outside the forwards.

Forward costs are ``forward_cost.py``'s served medians at batch 1, interpolated linearly in
the token count between its measured points. Printed per algorithm: the step cost in target
decodes (forward costs, then measured), the measured acceptance (tokens per step), the predicted and measured speedup over
``none``, and the acceptance a step of that cost would need for a given speedup (``--target``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cost_model.py", allow_abbrev=False)
    p.add_argument("--forward-cost", required=True, help="forward_cost.py JSON")
    p.add_argument("--bench", required=True, help="bench_speculative.py JSON (concurrency 1)")
    p.add_argument("--standalone-steps", type=int, default=3)
    p.add_argument("--mtp-k", type=int, default=2)
    p.add_argument("--specblock-nodes", type=int, default=8)
    p.add_argument("--target", type=float, default=1.3, help="speedup to solve acceptance for")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def interpolate(points: dict[int, float], n: float) -> float:
    """Piecewise-linear cost at ``n`` tokens from measured ``{tokens: ms}`` (extrapolated
    from the last two points past the ends)."""
    xs = sorted(points)
    if n in points:
        return points[n]
    if len(xs) < 2:
        raise ValueError("need at least two measured token counts")
    lo, hi = (xs[0], xs[1]) if n < xs[0] else (xs[-2], xs[-1])
    for a, b in zip(xs, xs[1:], strict=False):
        if a <= n <= b:
            lo, hi = a, b
            break
    slope = (points[hi] - points[lo]) / (hi - lo)
    return points[lo] + slope * (n - lo)


def served_costs(forward_cost: dict, batch_size: int = 1) -> tuple[dict, dict, dict]:
    """``({tokens: ms} target, {tokens: ms} draft, {k: ms} MTP_LORA gated step)`` served
    medians at ``batch_size`` (the last empty when the gated step was not timed)."""
    target, draft, mtp = {}, {}, {}
    for row in forward_cost["rows"]:
        if row["batch_size"] != batch_size:
            continue
        if row.get("shape") == "mtp_lora":
            mtp[row["mtp_k"]] = row["served_ms"]
        elif "shape" not in row:
            side = target if row["model"] == forward_cost["target"] else draft
            side[row["num_tokens"]] = row["served_ms"]
    return target, draft, mtp


def step_cost(
    algorithm: str,
    target: dict,
    draft: dict,
    args: argparse.Namespace,
    t_d_share: float | None,
    mtp: dict | None = None,
) -> float | None:
    """Forward cost (ms) of one step of ``algorithm``; None when the model has no form for it.
    ``mtp``: ``{k: ms}`` of MTP_LORA's gated step, measured (else priced as a chain verify)."""
    if algorithm in ("standalone-fixed", "standalone_sglang"):  # a chain of s drafts every step
        s = args.standalone_steps
        return (
            interpolate(target, s + 1) + (s - 1) * interpolate(draft, 1) + interpolate(draft, s + 2)
        )
    if algorithm == "mtp_lora":
        if mtp and args.mtp_k in mtp:
            return mtp[args.mtp_k]
        return interpolate(target, (args.mtp_k + 1) ** 2)
    if algorithm == "specblock-fixed" and t_d_share is not None and t_d_share < 1:
        return interpolate(target, args.specblock_nodes) / (1 - t_d_share)
    return None


def model_rows(forward_cost: dict, bench: dict, args: argparse.Namespace) -> list[dict]:
    target, draft, mtp = served_costs(forward_cost)
    decode = interpolate(target, 1)
    runs = {r["algorithm"]: r for r in bench["runs"]}
    rows = []
    for name, run in runs.items():
        if name == "none" or "error" in run:
            continue
        accept = run.get("mean_accept_length")
        t_d = run.get("draft_share_pct")
        cost = step_cost(name, target, draft, args, None if t_d is None else t_d / 100, mtp)
        measured = run.get("ratios", {}).get("output_throughput_paired") or run.get(
            "ratios", {}
        ).get("output_throughput")
        row = {"algorithm": name, "accept": accept, "measured_speedup": measured}
        if name == "mtp_lora":
            gated = args.mtp_k in mtp
            row["priced_as"] = "gated step" if gated else "chain verify"
            if gated:  # the old form beside it, to show what the gated forward adds
                row["chain_step_in_decodes"] = interpolate(target, (args.mtp_k + 1) ** 2) / decode
        if accept and measured:  # speedup = accept * T(1) / step, so step / T(1) follows
            row["measured_step_in_decodes"] = accept / measured
        if cost is not None and accept:
            row.update(
                step_in_decodes=cost / decode,
                predicted_speedup=accept * decode / cost,
                accept_needed=args.target * cost / decode,
            )
            if "measured_step_in_decodes" in row:  # [lean-step] item 1's ratio
                row["measured_over_predicted"] = row["measured_step_in_decodes"] / (cost / decode)
        rows.append(row)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return "-".rjust(width) if value is None else format(value, spec)


def main(argv: list[str]) -> list[dict]:
    args = parse_args(argv)
    forward_cost = json.loads(Path(args.forward_cost).read_text())
    bench = json.loads(Path(args.bench).read_text())
    rows = model_rows(forward_cost, bench, args)
    print(f"{'algorithm':<16} {'step/decode':>11} {'measured':>9} {'meas/pred':>9} {'accept':>7} "
          f"{'predicted':>10} {'measured':>9} {f'accept for {args.target}x':>17}")  # fmt: skip
    for r in rows:
        print(f"{r['algorithm']:<16} {_fmt(r.get('step_in_decodes'), '11.2f')} "
              f"{_fmt(r.get('measured_step_in_decodes'), '9.2f')} {_fmt(r.get('measured_over_predicted'), '9.2f')} "
              f"{_fmt(r['accept'], '7.2f')} {_fmt(r.get('predicted_speedup'), '10.2f')} "
              f"{_fmt(r['measured_speedup'], '9.2f')} {_fmt(r.get('accept_needed'), '17.2f')}")  # fmt: skip
        if "priced_as" in r:
            chain = r.get("chain_step_in_decodes")
            print(
                f"  {r['algorithm']}: priced as its {r['priced_as']}"
                + ("" if chain is None else f" (as a chain verify: {chain:.2f} decodes)")
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n"
        )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
