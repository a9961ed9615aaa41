"""Headline figures from a ``bench_speculative.py`` result JSON: one PNG per algorithm.

    .venv/bin/python benchmarks/plot_results.py benchmarks/results/sweep_s19.json \\
        --out-dir docs/img --table

For every algorithm but the reference (the first of the run, ``none``): output throughput and
TPOT against concurrency, the algorithm beside the reference, with the paired throughput
ratio at each point; for an MTP_LORA algorithm whose servers left a trace (``mtp_k_trace``,
from ``bench_speculative.py --concurrency``), a third panel with the k chosen at every decode
step over the run, its own measurement spans shaded per concurrency. The title names the host,
the date and the command of the run. ``--table`` prints the ratios as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure

DEFAULT_CONCURRENCY = 16  # bench_speculative.py's --max-concurrency default
REFERENCE_STYLE = {"color": "0.45", "marker": "s", "linestyle": "--"}
ALGORITHM_STYLE = {"color": "C0", "marker": "o", "linestyle": "-"}
PHASE_COLORS = ("C1", "C2", "C4", "C5", "C6", "C8")


def command_concurrency(command: str) -> int:
    """``--max-concurrency`` of an older single-concurrency command (rows without their own)."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--max-concurrency" and i + 1 < len(words):
            return int(words[i + 1])
        if word.startswith("--max-concurrency="):
            return int(word.split("=", 1)[1])
    return DEFAULT_CONCURRENCY


def load_rows(result: dict) -> list[dict]:
    """The result's rows, each with its ``max_concurrency``."""
    fallback = None
    rows = []
    for run in result["runs"]:
        if "max_concurrency" not in run:
            fallback = fallback or command_concurrency(result.get("command", ""))
            run = {**run, "max_concurrency": fallback}
        rows.append(run)
    return rows


def reference_name(rows: list[dict]) -> str:
    return rows[0]["algorithm"]


def row_at(rows: list[dict], algorithm: str, concurrency: int) -> dict | None:
    """The successful row of ``algorithm`` at ``concurrency``, if any."""
    for row in rows:
        if row["algorithm"] == algorithm and row["max_concurrency"] == concurrency:
            return None if "error" in row else row
    return None


def tpot_metric(rows: list[dict]) -> str:
    """Median TPOT where every successful row has it (newer runs), else the mean."""
    ok = [row for row in rows if "error" not in row]
    return "median_tpot_ms" if ok and all("median_tpot_ms" in r for r in ok) else "mean_tpot_ms"


def paired(row: dict, reference: dict, metric: str) -> float | None:
    """Median over rounds of each round's ``row / reference`` (the ratio of the two values
    without rounds); None where a value is missing."""
    rounds, reference_rounds = row.get("rounds"), reference.get("rounds")
    if not rounds or not reference_rounds or len(rounds) != len(reference_rounds):
        rounds, reference_rounds = [row], [reference]
    ratios = []
    for run, ref in zip(rounds, reference_rounds, strict=True):
        if run.get(metric) is None or not ref.get(metric):
            return None
        ratios.append(run[metric] / ref[metric])
    return statistics.median(ratios)


def series(rows: list[dict], algorithm: str, metric: str) -> tuple[list[int], list[float]]:
    """(concurrencies, values) of the successful rows of ``algorithm`` that have ``metric``."""
    points = sorted(
        (row["max_concurrency"], row[metric])
        for row in rows
        if row["algorithm"] == algorithm and "error" not in row and row.get(metric) is not None
    )
    return [c for c, _ in points], [v for _, v in points]


def algorithms(rows: list[dict]) -> list[str]:
    """Every algorithm but the reference that has a successful row, in run order."""
    names = []
    for row in rows:
        name = row["algorithm"]
        if name != reference_name(rows) and "error" not in row and name not in names:
            names.append(name)
    return names


def title(result: dict, algorithm: str, reference: str) -> str:
    host = result.get("host", {})
    where = f"{host.get('cpu_count', '?')}-CPU {host.get('cpu_model', 'unknown host')}"
    where += f", {host.get('device', '?')}"
    date = result.get("date", "date not recorded")
    words = shlex.split(result.get("command", ""))
    if words and "python" in Path(words[0]).name:
        words[0] = "python"
    command = textwrap.fill(shlex.join(words), 150)
    return f"{algorithm} vs {reference} -- {where}, {date}\n{command}"


def figure(result: dict, algorithm: str) -> Figure:
    """The figure of one algorithm (two panels, three with a k trace)."""
    rows = load_rows(result)
    reference = reference_name(rows)
    trace = result.get("mtp_k_trace", {}).get(algorithm)
    fig = Figure(figsize=(15 if trace else 10, 4.4), dpi=90, layout="constrained")
    axes = fig.subplots(1, 3 if trace else 2, width_ratios=[1, 1, 1.6] if trace else None)
    concurrencies = sorted({row["max_concurrency"] for row in rows})
    tpot = tpot_metric(rows)
    panels = (("output_throughput", "output tokens/s"), (tpot, f"{tpot.split('_')[0]} TPOT ms"))
    for ax, (metric, label) in zip(axes[:2], panels, strict=True):
        for name, style in ((reference, REFERENCE_STYLE), (algorithm, ALGORITHM_STYLE)):
            xs, ys = series(rows, name, metric)
            ax.plot(xs, ys, label=name, **style)
        annotate_ratios(ax, rows, algorithm, reference, metric)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(label)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the ratio labels
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title(f"throughput (x {reference}, paired)", fontsize=9)
    axes[1].set_title(f"TPOT (x {reference})", fontsize=9)
    if trace:
        plot_k_trace(axes[2], trace, [row for row in rows if row["algorithm"] == algorithm])
    fig.suptitle(title(result, algorithm, reference), fontsize=8)
    return fig


def annotate_ratios(ax, rows: list[dict], algorithm: str, reference: str, metric: str) -> None:
    for row in rows:
        ref = row_at(rows, reference, row["max_concurrency"])
        if row["algorithm"] != algorithm or "error" in row or ref is None:
            continue
        ratio = paired(row, ref, metric)
        if ratio is not None and row.get(metric) is not None:
            ax.annotate(
                f"{ratio:.2f}x",
                (row["max_concurrency"], row[metric]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )


def spans(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(concurrency, start, end) of every measurement of these rows (each round's)."""
    out = []
    for row in rows:
        for run in row.get("rounds") or [row]:
            if "t_start_s" in run:
                out.append((row["max_concurrency"], run["t_start_s"], run["t_end_s"]))
    return out


def plot_k_trace(ax, trace: list[dict], rows: list[dict]) -> None:
    """k per decode step over the run: a segment per run of equal k, a dot at its start (a
    one-step probe is too short to see as a line), each concurrency's spans shaded."""
    phases = spans(rows)
    concurrencies = sorted({c for c, _, _ in phases})
    for c in concurrencies:
        color = PHASE_COLORS[concurrencies.index(c) % len(PHASE_COLORS)]
        steps = [(s["k"], s["num_steps"]) for s in trace if in_phase(s, phases, c)]
        total = sum(n for _, n in steps)
        mean_k = sum(k * n for k, n in steps) / max(total, 1)
        label = (
            f"c={c}: mean k {mean_k:.2f} over {total} steps" if total else f"c={c}: no decode steps"
        )
        for i, (_, start, end) in enumerate(p for p in phases if p[0] == c):
            ax.axvspan(start, end, color=color, alpha=0.15, label=None if i else label)
    ax.hlines(
        [s["k"] for s in trace],
        [s["t_start_s"] for s in trace],
        [s["t_end_s"] for s in trace],
        color="C3",
        linewidth=2,
    )
    ax.plot([s["t_start_s"] for s in trace], [s["k"] for s in trace], ".", color="C3", ms=3)
    k_max = max([s["k"] for s in trace] + [1])
    ax.set_yticks(range(k_max + 1))
    ax.set_ylim(-0.3, k_max + 0.5)
    ax.set_xlabel("seconds since the benchmark started (other servers run in the gaps)")
    ax.set_ylabel("k (drafts per step)")
    ax.set_title("k chosen per decode step", fontsize=9)
    ax.grid(alpha=0.3)
    if phases:
        ax.legend(fontsize=8, loc="upper right")


def in_phase(segment: dict, phases: list[tuple[int, float, float]], concurrency: int) -> bool:
    return any(
        c == concurrency and start <= segment["t_start_s"] <= end for c, start, end in phases
    )


def markdown_table(result: dict) -> str:
    """Per concurrency and algorithm: tok/s, TPOT, their ratios to the reference, accept length
    and greedy equality."""
    rows = load_rows(result)
    reference = reference_name(rows)
    tpot = tpot_metric(rows)
    tpot_name = tpot.split("_")[0]
    lines = [
        f"| c | algorithm | out tok/s | x `{reference}` (paired) | {tpot_name} TPOT ms"
        f" | x `{reference}` TPOT | accept | greedy = `{reference}` |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(rows, key=lambda r: r["max_concurrency"]):
        c, name = row["max_concurrency"], row["algorithm"]
        if "error" in row:
            error = row["error"].splitlines()[0][:80].replace("|", "/")
            lines.append(f"| {c} | {name} | failed: {error} |{' - |' * 5}")
            continue
        ref = row_at(rows, reference, c)
        cells = [
            fmt(row.get("output_throughput")),
            fmt(paired(row, ref, "output_throughput") if ref else None, ".3f"),
            fmt(row.get(tpot)),
            fmt(paired(row, ref, tpot) if ref else None, ".3f"),
            fmt(row.get("mean_accept_length")),
            {True: "yes", False: "NO"}.get(row.get("greedy_equal_baseline"), "-"),
        ]
        lines.append(f"| {c} | {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plot_results.py", description=__doc__.split("\n")[0])
    parser.add_argument("json", help="a bench_speculative.py result JSON")
    parser.add_argument("--out-dir", default="docs/img", help="where <algorithm>.png go")
    parser.add_argument("--table", action="store_true", help="print the ratios in markdown")
    args = parser.parse_args(argv)
    result = json.loads(Path(args.json).read_text())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for algorithm in algorithms(load_rows(result)):
        path = out_dir / f"{algorithm}.png"
        figure(result, algorithm).savefig(path)
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    if args.table:
        print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
