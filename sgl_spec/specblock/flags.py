"""SPECBLOCK's command-line flags (a group of ``sgl_spec.config.SpecConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.flags import ConfigError, flag

SPECBLOCK_BRANCHING_NAMES = {"default": (2, 4, 10, 0), "fallback": (2, 4, 6, 4)}  # App. A.5
MAX_SPECBLOCK_NODES = 256
SPECBLOCK_DEFAULT_M = 2  # tree blocks per iteration (paper §4.1 setting)
SPECBLOCK_DEFAULT_MAX_NODES = 32  # verified tree nodes per request
# On the shipped target + drafters (filled by ``SpecBlock.with_shipped_defaults``): the node
# budget measured best on the CPU hosts (benchmarks/RESULTS.md), where a verified tree costs
# about linearly in its nodes.
SPECBLOCK_SHIPPED_MAX_NODES = 8
# On the shipped models the n-gram branch's nodes per request (``--specblock-ngram``), unless
# --specblock-adapt or --specblock-budget off is given: at or above SPECBLOCK without it at
# every load measured (benchmarks/RESULTS.md).
SPECBLOCK_SHIPPED_NGRAM = 8


@dataclass(frozen=True)
class SpecBlockFlags:
    specblock_drafter_path: str | None = flag(
        None,
        "--specblock-drafter-path",
        "SPECBLOCK: drafter directory (config.json + model.safetensors written by"
        " `python -m sgl_spec.specblock.train`).",
    )
    specblock_k: int | None = flag(
        None,
        "--specblock-k",
        "SPECBLOCK: draft positions used per block, at most the drafter's trained K"
        " (default: its K).",
        kind=int,
        bounds=(1, 64),
    )
    specblock_m: int = flag(
        SPECBLOCK_DEFAULT_M,
        "--specblock-m",
        "SPECBLOCK: tree blocks (batched drafter forwards) per iteration (default"
        f" {SPECBLOCK_DEFAULT_M}).",
        kind=int,
        bounds=(1, 16),
    )
    specblock_branching: str = flag(
        "default",
        "--specblock-branching",
        "SPECBLOCK: siblings per rank bucket b0..b3 (App. A.5): 'default' = 2,4,10,0,"
        " 'fallback' = 2,4,6,4, or four comma-separated integers.",
    )
    specblock_max_nodes: int | None = flag(
        None,
        "--specblock-max-nodes",
        "SPECBLOCK: tree nodes verified per request, root included (default"
        f" {SPECBLOCK_DEFAULT_MAX_NODES}; {SPECBLOCK_SHIPPED_MAX_NODES} on the shipped target,"
        " the measured best there).",
        kind=int,
        bounds=(2, MAX_SPECBLOCK_NODES),
    )
    specblock_budget: str = flag(
        "auto",
        "--specblock-budget",
        "SPECBLOCK: 'auto' (default) lets the speculation controller (sgl_spec/control) choose"
        " each step's node budget among 1 (no drafts: a plain decode step), 2, 4, ... and"
        " --specblock-max-nodes, from the measured step time and the running acceptance of"
        " each budget at the current batch size; 'fixed' verifies up to --specblock-max-nodes"
        " nodes every step; 'cycle' takes those budgets in turn, one"
        " step each (every switch exercised: for tests, not for serving); 'off' verifies the"
        " root alone every step (the floor 'auto' falls back to; for measuring it).",
        choices=("fixed", "auto", "cycle", "off"),
    )
    specblock_rank_head: str = flag(
        "on",
        "--specblock-rank-head",
        "SPECBLOCK: 'on' (default) shapes the tree with the drafter's rank head"
        " (--specblock-branching); 'off' grows fixed trees instead, the top 2 tokens at"
        " every position and later blocks from chain ends only (the paper's Table 2"
        " ablation, at serving time).",
        choices=("on", "off"),
    )
    specblock_drafter_dtype: str = flag(
        "auto",
        "--specblock-drafter-dtype",
        "SPECBLOCK: dtype of the drafter's weights, KV cache and activations (drafts only;"
        " outputs are the target's either way): 'auto' (default) = the target's dtype,"
        " or float32, bfloat16, float16.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    specblock_ngram: int | None = flag(
        None,
        "--specblock-ngram",
        "SPECBLOCK: also offer up to N nodes (root included) per request from SGLang's n-gram"
        " corpus of the prompts and outputs seen (what NGRAM drafts from), merged into the"
        " drafter's tree before the node budget cuts it (specblock/ngram_branch.py); 0 = off."
        f" Default: {SPECBLOCK_SHIPPED_NGRAM} on the shipped target (the measured best there)"
        " unless --specblock-adapt or --specblock-budget off is given, else off. Not with"
        " either of those.",
        kind=int,
        bounds=(0, 64),
    )
    specblock_adapt: bool = flag(
        False,
        "--specblock-adapt",
        "SPECBLOCK: cost-aware online adaptation of the drafter while serving (paper"
        " §3.4): a bandit picks skip / head-only / full updates from the verifier's signal;"
        " updates train a copy on a background thread. Off by default; outputs unchanged.",
        kind="switch",
        requires="SPECBLOCK",
    )
    specblock_adapt_options: str | None = flag(
        None,
        "--specblock-adapt-options",
        "SPECBLOCK with --specblock-adapt: override adaptation constants as"
        " key=value,... (fields of sgl_spec.specblock.adapt.AdaptConfig, e.g."
        " warmup_queries=10,measure_queries=8,buffer_queries=4,lr=3e-4).",
    )

    def validate(self) -> None:
        """Checks beyond the declared ones; ``ConfigError`` naming the flag."""
        specblock_bucket_map(self.specblock_branching)
        if self.specblock_ngram == 1:
            raise ConfigError(
                "--specblock-ngram must be 0 (off) or >= 2: a tree of 1 node drafts nothing"
            )
        if self.specblock_ngram and self.specblock_adapt:
            raise ConfigError(
                "--specblock-ngram with --specblock-adapt: adaptation learns from the drafter's"
                " own nodes only; drop one"
            )
        if self.specblock_ngram and self.specblock_budget == "off":
            raise ConfigError(
                "--specblock-ngram with --specblock-budget off: 'off' verifies the root alone"
                " every step, so no n-gram node would be verified; drop one"
            )
        if self.specblock_adapt_options is not None:
            if not self.specblock_adapt:
                raise ConfigError("--specblock-adapt-options needs --specblock-adapt")
            from sgl_spec.specblock.adapt.policy import AdaptConfig

            try:
                AdaptConfig.parse(self.specblock_adapt_options)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"--specblock-adapt-options: {exc}") from None

    @property
    def specblock_bucket_map(self) -> tuple[int, int, int, int]:
        return specblock_bucket_map(self.specblock_branching)


def specblock_bucket_map(value: str) -> tuple[int, int, int, int]:
    """``--specblock-branching``: a name of App. A.5's maps or four widths ``w0,w1,w2,w3``."""
    if value in SPECBLOCK_BRANCHING_NAMES:
        return SPECBLOCK_BRANCHING_NAMES[value]
    parts = str(value).split(",")
    try:
        widths = tuple(int(p) for p in parts)
    except ValueError:
        widths = ()
    if len(widths) != 4 or min(widths) < 0 or max(widths) < 1 or max(widths) > 64:
        raise ConfigError(
            "--specblock-branching must be 'default' (2,4,10,0), 'fallback' (2,4,6,4) or four"
            f" comma-separated widths in 0..64 with one > 0; got {value!r}"
        )
    return widths  # type: ignore[return-value]


FLAGS = SpecBlockFlags
