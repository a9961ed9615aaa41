"""Pure helpers of ``bench_speculative.py``: CLI, algorithm -> server flags, results and ratios.

No servers or subprocesses here, so all of it is unit-tested without a model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shlex
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import code_prompts
from _bracket import add_bracketed_ratios
from code_prompts import PROMPT_SETS

from sgl_spec.argv import drop_flags, flag_value, has_flag

# Metrics read from ``sglang.bench_serving``'s output file, and the ones given as ratios.
BENCH_METRICS = ("output_throughput", "mean_e2e_latency_ms", "p99_e2e_latency_ms", "mean_tpot_ms")
# Read when bench_serving reports them (absent otherwise).
OPTIONAL_BENCH_METRICS = ("median_tpot_ms",)
RATIO_METRICS = ("output_throughput", "mean_e2e_latency_ms", "mean_tpot_ms")
SPECULATIVE_PREFIX = "--speculative-"
# Token ids of the benchmarks' own prompts: below 250 so that any real vocabulary (and the
# tests' tiny 512-token one) holds them, above 10 to skip the usual special tokens.
TOKEN_RANGE = (10, 250)
RESERVED_FLAGS = ("--host", "--port")
# --interleave keeps every server up at once: each needs a capped KV pool (SGLang otherwise
# sizes it from free memory, and the second server finds none), and idle ones must sleep.
POOL_CAP_FLAGS = ("--max-total-tokens", "--mem-fraction-static")
IDLE_SLEEP_FLAG = "--sleep-on-idle"
HOST = "127.0.0.1"
BENCH_SERVING_FIXED = (
    f"--backend sglang --host {HOST} --dataset-name random-ids --random-range-ratio 1.0 "
    "--seed 1 --disable-tqdm"
).split()

CHAIN_DEFAULTS = (
    ("--speculative-num-steps", "3"),
    ("--speculative-eagle-topk", "1"),
    ("--speculative-num-draft-tokens", "4"),
)


@dataclass(frozen=True)
class Algorithm:
    """How one ``--algorithms`` name becomes server flags.

    ``flags`` are always passed; ``defaults`` only where the user did not give that flag.
    A non-speculative algorithm drops every pass-through ``--speculative-*`` flag (e.g. the
    draft model path that the speculative runs of the same invocation need).
    """

    flags: tuple[str, ...] = ()
    defaults: tuple[tuple[str, str], ...] = ()
    speculative: bool = True
    own_speculative_flags: bool = False  # drop pass-through --speculative-* (no draft model)
    env: tuple[tuple[str, str], ...] = ()  # set for this server only
    peer: bool = False  # no server: Hugging Face transformers generate (hf_peer.py)


ALGORITHMS: dict[str, Algorithm] = {
    "none": Algorithm(speculative=False),
    # sgl-spec's STANDALONE_FULL (SGLang's STANDALONE, the draft reading the whole sequence)
    # at its default: the chain length chosen per step (auto) on this CPU engine
    "standalone": Algorithm(("--speculative-algorithm", "STANDALONE_FULL"), CHAIN_DEFAULTS),
    # the fixed chain: --speculative-num-steps drafts every step
    "standalone-fixed": Algorithm(
        ("--speculative-algorithm", "STANDALONE_FULL", "--standalone-steps", "fixed"),
        CHAIN_DEFAULTS,
    ),
    # the chain length chosen per step by the speculation controller (sgl_spec/control), 0 to
    # the chain's --speculative-num-steps; 0 is a step without drafts
    "standalone-auto": Algorithm(
        ("--speculative-algorithm", "STANDALONE_FULL", "--standalone-steps", "auto"),
        CHAIN_DEFAULTS,
    ),
    # every step at 0 drafts: the floor `standalone-auto` reaches when its controller keeps
    # drafting off
    "standalone-off": Algorithm(
        ("--speculative-algorithm", "STANDALONE_FULL", "--standalone-steps", "off"),
        CHAIN_DEFAULTS,
    ),
    # SGLang's own STANDALONE (EAGLE's shifted draft layout), for comparison
    "standalone_sglang": Algorithm(("--speculative-algorithm", "STANDALONE"), CHAIN_DEFAULTS),
    # fixed k (the shipped adapter's k_max is 4); --mtp-k on the command line overrides it
    "mtp_lora": Algorithm(
        ("--speculative-algorithm", "MTP_LORA"), (("--mtp-k", "2"),), own_speculative_flags=True
    ),
    # k chosen per step by the speculation controller (served step times; optional prior
    # --mtp-gamma-table TABLE.json)
    "mtp_lora_auto": Algorithm(
        ("--speculative-algorithm", "MTP_LORA", "--mtp-k", "auto"), own_speculative_flags=True
    ),
    # the adapter loaded and every step plain (k = 0): the floor `mtp_lora_auto` can reach
    # when its controller keeps speculation off
    "mtp_lora_off": Algorithm(
        ("--speculative-algorithm", "MTP_LORA", "--mtp-k", "0"), own_speculative_flags=True
    ),
    # the shipped K = 4 drafter on the shipped target (the launcher fills it in), M = 2 blocks,
    # at its default: the node budget chosen per step (--specblock-budget auto), with the n-gram
    # branch of 8 nodes (the launcher's default on the shipped target)
    "specblock": Algorithm(("--speculative-algorithm", "SPECBLOCK"), own_speculative_flags=True),
    # the fixed budget: up to --specblock-max-nodes nodes every step
    "specblock-fixed": Algorithm(
        ("--speculative-algorithm", "SPECBLOCK", "--specblock-budget", "fixed"),
        own_speculative_flags=True,
    ),
    # the node budget chosen per step by the speculation controller (sgl_spec/control), up to
    # the shipped --specblock-max-nodes; budget 1 is a step without drafts
    "specblock-auto": Algorithm(
        ("--speculative-algorithm", "SPECBLOCK", "--specblock-budget", "auto"),
        own_speculative_flags=True,
    ),
    # the drafter's tree merged with SGLang's n-gram corpus drafts (8 nodes per request offered)
    "specblock-ngram": Algorithm(
        ("--speculative-algorithm", "SPECBLOCK", "--specblock-ngram", "8"),
        own_speculative_flags=True,
    ),
    # the default without the n-gram branch: the drafter's trees alone
    "specblock-nongram": Algorithm(
        ("--speculative-algorithm", "SPECBLOCK", "--specblock-ngram", "0"),
        own_speculative_flags=True,
    ),
    # every step the root alone (no drafts; the drafter still follows): the floor of
    # `specblock-auto` when its controller keeps drafting off
    "specblock-off": Algorithm(
        ("--speculative-algorithm", "SPECBLOCK", "--specblock-budget", "off"),
        own_speculative_flags=True,
    ),
    # the same drafter trained with K = 1 at the same tree budget (depth M * K = 8; node budget
    # --specblock-max-nodes, the launcher's default on the shipped target when not given)
    "specblock-k1": Algorithm(
        (
            "--speculative-algorithm",
            "SPECBLOCK",
            "--specblock-drafter-path",
            "sgl-spec/tiny-code-specblock-k1",
            "--specblock-budget",
            "fixed",
        ),
        (("--specblock-m", "8"),),
        own_speculative_flags=True,
    ),
    # the draft server on a core of its own (cpu:1, the last core); the target keeps the rest;
    # at its default: the drafts of each step chosen by the controller (--minedraft-steps auto)
    "minedraft": Algorithm(
        ("--speculative-algorithm", "MINEDRAFT"),
        (("--speculative-num-steps", "3"), ("--speculative-draft-device", "cpu:1")),
    ),
    # the fixed chain: --speculative-num-steps drafts every step
    "minedraft-fixed": Algorithm(
        ("--speculative-algorithm", "MINEDRAFT", "--minedraft-steps", "fixed"),
        (("--speculative-num-steps", "3"), ("--speculative-draft-device", "cpu:1")),
    ),
    # the shipped SpecBlock drafter (K = 4) in the draft server: one block per step
    "minedraft-specblock": Algorithm(
        (
            "--speculative-algorithm",
            "MINEDRAFT",
            "--minedraft-drafter",
            "specblock",
            "--minedraft-steps",
            "fixed",
        ),
        (("--speculative-num-steps", "4"), ("--speculative-draft-device", "cpu:1")),
    ),
    # the same, every step standard SD through the draft server: what the overlap gains
    "minedraft-sequential": Algorithm(
        (
            "--speculative-algorithm",
            "MINEDRAFT",
            "--minedraft-overlap",
            "off",
            "--minedraft-steps",
            "fixed",
        ),
        (("--speculative-num-steps", "3"), ("--speculative-draft-device", "cpu:1")),
    ),
    # drafts verified per step chosen by the speculation controller, 0 (a plain decode step,
    # waiting for no drafts) to 3; and 0 every step (nothing sent), the floor it falls back to
    "minedraft-auto": Algorithm(
        ("--speculative-algorithm", "MINEDRAFT", "--minedraft-steps", "auto"),
        (("--speculative-num-steps", "3"), ("--speculative-draft-device", "cpu:1")),
    ),
    # the same without sending the draft server what it lags during plain steps
    "minedraft-auto-nocatchup": Algorithm(
        ("--speculative-algorithm", "MINEDRAFT", "--minedraft-steps", "auto"),
        (("--speculative-num-steps", "3"), ("--speculative-draft-device", "cpu:1")),
        env=(("SGLSPEC_MINEDRAFT_CATCH_UP_TOKENS", "0"),),
    ),
    "minedraft-off": Algorithm(
        ("--speculative-algorithm", "MINEDRAFT", "--minedraft-steps", "off"),
        (("--speculative-num-steps", "3"), ("--speculative-draft-device", "cpu:1")),
    ),
    # STANDALONE_FULL held to one core (SGLang's CPU thread binding): with "minedraft" on a
    # 2-core host this is the paper's setting, the same target device plus one for drafting
    "standalone-1core": Algorithm(
        ("--speculative-algorithm", "STANDALONE_FULL"),
        CHAIN_DEFAULTS,
        env=(("SGLANG_CPU_OMP_THREADS_BIND", "0"),),
    ),
    "none-1core": Algorithm(speculative=False, env=(("SGLANG_CPU_OMP_THREADS_BIND", "0"),)),
    # SGLang's own model-free drafting (n-gram matches in the request's context), its
    # defaults (12 draft tokens, a BFS tree) and a smaller verify (8 tokens, the tuned row)
    "ngram": Algorithm(("--speculative-algorithm", "NGRAM"), own_speculative_flags=True),
    "ngram-8": Algorithm(
        ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"),
        own_speculative_flags=True,
    ),
    # peers, no server (hf_peer.py): transformers generate on the same target, batch 1, and the
    # same with assistant_model= the run's draft (assisted generation)
    "hf": Algorithm(speculative=False, peer=True),
    "hf-assisted": Algorithm(peer=True),
}
# Server-side metrics read from the last metrics line an algorithm's worker logged
# (cumulative over the server's life): log prefix -> {key in the line: key in the results}.
SERVER_METRIC_LINES = {
    "SPECBLOCK: steps=": {
        "T_D%": "draft_share_pct",
        "drafter_forwards_per_iter": "drafter_forwards_per_iter",
        "mean_accept_length": "server_accept_length",
        "mean_step_ms": "server_mean_step_ms",
    },
    "MINEDRAFT: steps=": {
        "coverage": "coverage",
        "mean_accept_length": "server_accept_length",
        "draft_ms": "draft_ms_per_step",
        "verify_ms": "verify_ms_per_step",
        "overlap_ms": "overlap_ms_per_step",
        "wait_ms": "wait_ms_per_step",
        "overlap_bound": "overlap_bound",
        "faults": "draft_server_faults",
    },
}
SERVER_METRICS = tuple(k for keys in SERVER_METRIC_LINES.values() for k in keys.values())


class BenchError(ValueError):
    """A bad command line, reported before any server starts."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our flags, plus the unknown ones, which go unchanged to every server."""
    parser = argparse.ArgumentParser(
        prog="bench_speculative.py",
        allow_abbrev=False,
        description="Serve each algorithm in turn with sgl_spec.launch_server, drive it with "
        "sglang.bench_serving, and report metrics with ratios against the first algorithm. "
        "Unknown flags are passed to every server (e.g. --model-path M).",
    )
    parser.add_argument(
        "--algorithms",
        required=True,
        help="comma list; the first is the reference for ratios. hf and hf-assisted start no "
        "server: Hugging Face transformers generate on the same target, batch 1, plain and with "
        "assistant_model= the draft (benchmarks/hf_peer.py). "
        f"Known: {', '.join(ALGORITHMS)}",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'NAME=BASE FLAGS'",
        help="a named algorithm made of a known one plus server flags, usable in --algorithms,"
        " e.g. --variant 'specblock-n8=specblock --specblock-max-nodes 8'; repeatable",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=None, help="default 16")
    parser.add_argument(
        "--concurrency",
        default=None,
        metavar="C1,C2,...",
        help="a sweep instead of one --max-concurrency: the whole comparison (every round) at "
        "each concurrency in turn; with --interleave on the same servers, started once. "
        "Each row of the JSON names its max_concurrency; ratios are within a concurrency",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument(
        "--prompts",
        choices=PROMPT_SETS,
        default="random-ids",
        help="random-ids: bench_serving's random-token prompts; code: windows of held-out "
        "Python source no shipped model was trained on (benchmarks/code_prompts.py), for the "
        "servers, the greedy check and the transformers peers alike",
    )
    parser.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="send every round the same prompts and flush nothing (the protocol of runs before "
        "2026-12-07). By default each round draws prompts of its own (bench_serving's seed + "
        "round; code windows that never overlap) and each server's caches are flushed after "
        "bench_serving's warm-up and before the greedy check, so no server meets a prompt or "
        "a continuation it has served: SGLang's NGRAM keeps every output in its corpus and "
        "would otherwise replay them",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--port-base", type=int, default=31000)
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds for a server start, and for a bench"
    )
    parser.add_argument("--log-dir", default=None, help="server / bench logs (default: a tmp dir)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="serve every algorithm this many times, alternating the order (A B C, C B A, ...)"
        " so that a drift in host load hits all alike; metrics are the median over rounds",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every algorithm's server once and keep them all up (idle ones sleep, "
        f"{IDLE_SLEEP_FLAG}); each round drives them in turn, so host drift falls on all alike. "
        "Needs a KV pool cap for the servers to share memory: --max-total-tokens N "
        "(or --mem-fraction-static F on a GPU)",
    )
    parser.add_argument(
        "--bracket",
        action="store_true",
        help="with --interleave: run the first algorithm also between every two other runs "
        "of a round and divide each run by the mean of the two around it (x bracketed): the "
        "host's drift within a round cancels, at about twice the runs",
    )
    args, extra = parser.parse_known_args(argv)
    for text in args.variant:
        register_variant(text)
    args.algorithms = parse_algorithms(args.algorithms)
    args.concurrencies = parse_concurrencies(args.concurrency, args.max_concurrency)
    args.max_concurrency = args.concurrencies[0]
    if args.interleave and not any(has_flag(extra, flag) for flag in POOL_CAP_FLAGS):
        raise BenchError(
            "--interleave keeps every server up at once, and SGLang sizes each KV pool from "
            "the memory free at its start: cap it with --max-total-tokens N (CPU) or "
            "--mem-fraction-static F (GPU, shared by all the servers)"
        )
    if args.bracket and not args.interleave:
        raise BenchError("--bracket runs the first algorithm between the others: add --interleave")
    if args.bracket and len(args.algorithms) < 2:
        raise BenchError("--bracket needs a second algorithm to compare with the first")
    for name in ("num_prompts", "max_concurrency", "output_len", "input_len", "rounds"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    for flag in RESERVED_FLAGS:
        if has_flag(extra, flag):
            raise BenchError(f"{flag} is chosen by the benchmark; use --port-base instead")
    for algorithm in args.algorithms:
        for flag in ALGORITHMS[algorithm].flags:
            if flag.startswith("--") and has_flag(extra, flag):
                raise BenchError(f"{flag} is set by --algorithms ({algorithm}); remove it")
    return args, extra


BUILTIN_ALGORITHMS = frozenset(ALGORITHMS)
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=.*")


def register_variant(text: str) -> str:
    """``--variant 'NAME=BASE [ENV=VALUE ...] [--flag value ...]'``: ``NAME`` runs ``BASE`` with
    the flags added (they win over ``BASE``'s defaults) and the environment variables set for
    its server only. Returns ``NAME``; it joins :data:`ALGORITHMS`."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise BenchError(f"--variant {text!r}: {exc}") from None
    if not sep or not name or not words:
        raise BenchError(f"--variant needs 'NAME=BASE [FLAGS...]', got {text!r}")
    if name in BUILTIN_ALGORITHMS or not VARIANT_NAME.fullmatch(name):
        raise BenchError(
            f"--variant {text!r}: the name must be new and of letters, digits, '.', '_', '-'"
        )
    base_name, rest = words[0], list(words[1:])
    env = []
    while rest and ENV_ASSIGNMENT.fullmatch(rest[0]):
        key, _, value = rest.pop(0).partition("=")
        env.append((key, value))
    flags = tuple(rest)
    if base_name not in BUILTIN_ALGORITHMS:
        raise BenchError(
            f"--variant {text!r}: unknown base {base_name!r};"
            f" known: {', '.join(sorted(BUILTIN_ALGORITHMS))}"
        )
    if flags and not flags[0].startswith("--"):
        raise BenchError(f"--variant {text!r}: flags must start with --, got {flags[0]!r}")
    base = ALGORITHMS[base_name]
    if base.peer:
        raise BenchError(f"--variant {text!r}: {base_name} runs no server, so takes no flags")
    if not base.speculative and any(f.startswith(SPECULATIVE_PREFIX) for f in flags):
        raise BenchError(f"--variant {text!r}: {base_name} takes no --speculative-* flags")
    given = {f for f in flags if f.startswith("--")}
    ALGORITHMS[name] = dataclasses.replace(
        base,
        flags=(*base.flags, *flags),
        defaults=tuple((f, v) for f, v in base.defaults if f not in given),
        env=(*base.env, *env),
    )
    return name


def parse_algorithms(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise BenchError("--algorithms is empty")
    unknown = [name for name in names if name not in ALGORITHMS]
    if unknown:
        raise BenchError(
            f"unknown algorithm(s) {', '.join(unknown)} in --algorithms; "
            f"known: {', '.join(ALGORITHMS)} (lower-case)"
        )
    if len(set(names)) != len(names):
        raise BenchError(f"--algorithms lists a name twice: {text}")
    return names


def parse_concurrencies(sweep: str | None, max_concurrency: int | None) -> list[int]:
    """The concurrencies to run: ``--concurrency 1,4,16``, else ``--max-concurrency`` (16)."""
    if sweep is None:
        return [16 if max_concurrency is None else max_concurrency]
    if max_concurrency is not None:
        raise BenchError("give --concurrency (a sweep) or --max-concurrency, not both")
    try:
        values = [int(word) for word in sweep.split(",") if word.strip()]
    except ValueError:
        raise BenchError(f"--concurrency needs integers like 1,4,16, got {sweep!r}") from None
    if not values or min(values) < 1:
        raise BenchError(f"--concurrency needs integers >= 1, got {sweep!r}")
    if len(set(values)) != len(values):
        raise BenchError(f"--concurrency lists a value twice: {sweep}")
    return values


def server_flags(algorithm: str, extra: list[str]) -> list[str]:
    """Flags for one server: the pass-through flags plus the algorithm's own."""
    spec = ALGORITHMS[algorithm]
    if model_path(extra) is None:
        # Name the launcher's default target: with no --model-path at all the launcher would
        # also turn speculation on, and the "none" baseline would silently speculate.
        from sgl_spec.models.registry import DEFAULT_TARGET

        extra = [*extra, "--model-path", DEFAULT_TARGET]
    if not spec.speculative:
        return [*drop_flags(extra, SPECULATIVE_PREFIX), *spec.flags]
    if spec.own_speculative_flags:
        extra = drop_flags(extra, SPECULATIVE_PREFIX)
    flags = [*extra, *spec.flags]
    for name, value in spec.defaults:
        if not has_flag(extra, name):
            flags += [name, value]
    return flags


def interleave_flags(extra: list[str]) -> list[str]:
    """The pass-through flags of a server that waits idle while the others run."""
    return extra if has_flag(extra, IDLE_SLEEP_FLAG) else [*extra, IDLE_SLEEP_FLAG]


@contextlib.contextmanager
def algorithm_env(algorithm: str, extra: dict[str, str] | None = None) -> Iterator[None]:
    """The algorithm's environment variables and ``extra``, set while its server starts
    (inherited)."""
    env = {**dict(ALGORITHMS[algorithm].env), **(extra or {})}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def model_path(extra: list[str]) -> str | None:
    return flag_value(extra, "--model-path") or flag_value(extra, "--model")


def is_reference_baseline(algorithms: list[str]) -> bool:
    """Greedy equality is meaningful only against a non-speculative first run."""
    return not ALGORITHMS[algorithms[0]].speculative


def mean_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def pick_accept_length(bench: float | None, greedy: float | None) -> dict:
    """``mean_accept_length`` (accepted draft tokens + the bonus token, per verify step).

    Prefer the server's running mean over the benchmark itself; SGLang updates it only every
    ``--decode-log-interval`` (40) decode steps, so short runs fall back to the mean of
    ``meta_info.spec_accept_length`` over the fixed greedy requests.
    """
    if bench is not None:
        return {"mean_accept_length": bench, "accept_length_source": "bench_serving"}
    if greedy is not None:
        return {"mean_accept_length": greedy, "accept_length_source": "greedy"}
    return {"mean_accept_length": None, "accept_length_source": None}


def parse_server_metrics(log_text: str) -> dict[str, float]:
    """The metrics of the last worker metrics line in a server log (see SERVER_METRIC_LINES);
    empty when the algorithm logs none."""
    for line in reversed(log_text.splitlines()):
        for prefix, keys in SERVER_METRIC_LINES.items():
            if prefix not in line:
                continue
            fields = dict(
                token.split("=", 1) for token in line.split(prefix, 1)[1].split() if "=" in token
            )
            found = {}
            for key, name in keys.items():
                try:
                    found[name] = float(fields[key])
                except (KeyError, ValueError):
                    continue
            return found
    return {}


def add_ratios(runs: list[dict]) -> None:
    """``ratios[m] = run[m] / runs[0][m]`` for each ratio metric (None where undefined)."""
    reference = runs[0] if runs and "error" not in runs[0] else {}
    for run in runs:
        if "error" in run:
            continue
        ratios = {}
        for metric in RATIO_METRICS:
            ref, value = reference.get(metric), run.get(metric)
            ratios[metric] = value / ref if ref and value is not None else None
        per_round = paired_ratios(run.get("rounds"), reference.get("rounds"), "output_throughput")
        ratios["output_throughput_paired"] = (
            None if per_round is None else statistics.median(per_round)
        )
        ratios["output_throughput_paired_range"] = (
            None if per_round is None or len(per_round) < 2 else [min(per_round), max(per_round)]
        )
        run["ratios"] = ratios


def paired_ratios(
    rounds: list[dict] | None, reference: list[dict] | None, metric: str
) -> list[float] | None:
    """``rounds[r][metric] / reference[r][metric]`` per round r: each round's runs ran back to
    back. None without rounds on both sides, or where a round lacks the metric."""
    if not rounds or not reference or len(rounds) != len(reference):
        return None
    pairs = [(run.get(metric), ref.get(metric)) for run, ref in zip(rounds, reference, strict=True)]
    if any(not ref or value is None for value, ref in pairs):
        return None
    return [value / ref for value, ref in pairs]


def paired_ratio(
    rounds: list[dict] | None, reference: list[dict] | None, metric: str
) -> float | None:
    """Median over rounds of ``rounds[r][metric] / reference[r][metric]`` (``paired_ratios``):
    this cancels drift between rounds that a ratio of medians keeps."""
    per_round = paired_ratios(rounds, reference, metric)
    return None if per_round is None else statistics.median(per_round)


def round_orders(algorithms: list[str], rounds: int) -> list[list[str]]:
    """Visit order per round: forward, backward, forward, ..."""
    return [list(algorithms) if r % 2 == 0 else list(reversed(algorithms)) for r in range(rounds)]


def combine_rounds(runs: list[dict]) -> dict:
    """One algorithm's result from its rounds: the median of each metric, the first round's
    greedy ids, and ``greedy_rounds_equal`` (every round produced the same ids). Any failed
    round fails the algorithm; the per-round metrics stay under ``rounds``."""
    if len(runs) == 1:
        return runs[0]
    combined: dict = {"algorithm": runs[0]["algorithm"]}
    errors = [run["error"] for run in runs if "error" in run]
    if errors:
        combined["error"] = errors[0]
        return combined
    optional = (*OPTIONAL_BENCH_METRICS, *SERVER_METRICS)
    for metric in (*BENCH_METRICS, *OPTIONAL_BENCH_METRICS, "mean_accept_length", *SERVER_METRICS):
        values = [run.get(metric) for run in runs]
        if metric in optional and all(v is None for v in values):
            continue
        combined[metric] = None if None in values else statistics.median(values)
    ids = [run.get("greedy_output_ids") for run in runs]
    combined["greedy_output_ids"] = ids[0]
    combined["greedy_rounds_equal"] = all(i == ids[0] for i in ids)
    combined["rounds"] = [
        {k: v for k, v in run.items() if k != "greedy_output_ids"} for run in runs
    ]
    return combined


def assemble(command: str, host: dict, algorithms: list[str], runs: list[dict]) -> dict:
    """The result JSON: greedy equality against a non-speculative first run, then ratios.

    Consumes each run's ``greedy_output_ids``; failed runs keep only their ``error``.
    """
    reference = runs[0].get("greedy_output_ids") if is_reference_baseline(algorithms) else None
    for i, run in enumerate(runs):
        ids = run.pop("greedy_output_ids", None)
        if "error" not in run:
            equal = None if i == 0 or reference is None or ids is None else ids == reference
            if equal is not None and run.get("greedy_rounds_equal") is False:
                equal = False  # some round differed from the round compared here
            run["greedy_equal_baseline"] = equal
    add_ratios(runs)
    add_bracketed_ratios(runs)
    return {"command": command, "host": host, "runs": runs}


def fresh_prompts(args: argparse.Namespace) -> bool:
    """Does each round draw prompts of its own, with caches flushed (not ``--repeat-prompts``)?
    A load without the option (tests' own namespaces) keeps the fixed prompts."""
    return hasattr(args, "repeat_prompts") and not args.repeat_prompts


def round_seed(args: argparse.Namespace) -> int:
    """bench_serving's seed for this pass: the fixed one, plus the round (``round_index``)
    where each round draws prompts of its own."""
    seed = int(flag_value(BENCH_SERVING_FIXED, "--seed"))
    return seed + getattr(args, "round_index", 0) if fresh_prompts(args) else seed


def bench_serving_argv(
    port: int, args: argparse.Namespace, model: str | None, output_file: Path
) -> list[str]:
    """``sglang.bench_serving`` on the offline ``random-ids`` dataset (``random`` downloads
    ShareGPT), fixed lengths (range ratio 1.0) and seed, so every algorithm gets the same load;
    with ``args.dataset_path`` (``--prompts code``) on that ``custom`` file instead."""
    options = {
        "--port": port,
        "--random-input-len": args.input_len,
        "--random-output-len": args.output_len,
        "--num-prompts": args.num_prompts,
        "--max-concurrency": args.max_concurrency,
        "--output-file": output_file,
    }
    if model is not None:
        options["--tokenizer"] = model
    pairs = [str(item) for option in options.items() for item in option]
    fixed = list(BENCH_SERVING_FIXED)
    fixed[fixed.index("--seed") + 1] = str(round_seed(args))
    if fresh_prompts(args):
        # after its warm-up (a request of the measured prompts), flush what the server kept
        pairs.append("--flush-cache")
    dataset = getattr(args, "dataset_path", None)
    if dataset is not None:  # --prompts code: the file main() wrote
        fixed[fixed.index("--dataset-name") : fixed.index("--dataset-name") + 2] = []
        pairs += code_prompts.bench_serving_dataset(dataset, args.output_len)
    return [sys.executable, "-m", "sglang.bench_serving", *fixed, *pairs]


def parse_bench_result(jsonl: str, num_prompts: int) -> dict:
    """Our metrics from ``sglang.bench_serving``'s output file (one JSON object per run).

    ``accept_length`` is the server's running mean (``/server_info``), absent without
    speculative decoding.
    """
    lines = jsonl.strip().splitlines()
    if not lines:
        raise ValueError("bench_serving wrote no result")
    result = json.loads(lines[-1])
    if result.get("completed") != num_prompts:
        raise ValueError(
            f"bench_serving completed {result.get('completed')}/{num_prompts} requests"
        )
    metrics = {name: float(result[name]) for name in BENCH_METRICS}
    for name in OPTIONAL_BENCH_METRICS:
        if result.get(name) is not None:
            metrics[name] = float(result[name])
    accept = result.get("accept_length")
    metrics["bench_accept_length"] = float(accept) if accept else None
    return metrics


def host_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        sglang_version = version("sglang")
    except PackageNotFoundError:
        sglang_version = None
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.device_count()}x {torch.cuda.get_device_name(0)})"
    else:
        device = "cpu"
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch_version": torch.__version__,
        "sglang_version": sglang_version,
        "device": device,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(value: float | bool | None, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def _fmt_range(bounds: list[float] | None) -> str:
    return "-" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def format_table(runs: list[dict]) -> str:
    """A fixed-width table; ratios are against the first run (x = run / first)."""
    header = ["algorithm", "out tok/s", "e2e ms", "p99 e2e ms", "tpot ms", "accept", "T_D%"]
    header += ["greedy="]
    header += ["x tok/s", "x e2e", "x tpot", "x tok/s paired", "paired min-max"]
    bracketed = any("output_throughput_bracketed" in run.get("ratios", {}) for run in runs)
    if bracketed:
        header += ["x bracketed", "bracketed min-max"]
    rows, errors = [header], []
    for run in runs:
        if "error" in run:
            errors.append(f"{run['algorithm']}: ERROR {run['error'].splitlines()[0][:120]}")
            continue
        ratios = run.get("ratios", {})
        rows.append(
            [
                run["algorithm"],
                _fmt(run["output_throughput"]),
                _fmt(run["mean_e2e_latency_ms"], ".1f"),
                _fmt(run["p99_e2e_latency_ms"], ".1f"),
                _fmt(run["mean_tpot_ms"]),
                _fmt(run["mean_accept_length"]),
                _fmt(run.get("draft_share_pct"), ".1f"),
                _fmt(run["greedy_equal_baseline"]),
                *(_fmt(ratios.get(m), ".3f") for m in RATIO_METRICS),
                _fmt(ratios.get("output_throughput_paired"), ".3f"),
                _fmt_range(ratios.get("output_throughput_paired_range")),
            ]
        )
        if bracketed:
            rows[-1] += [
                _fmt(ratios.get("output_throughput_bracketed"), ".3f"),
                _fmt_range(ratios.get("output_throughput_bracketed_range")),
            ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    return "\n".join(lines + errors)
