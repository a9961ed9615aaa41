"""Our command-line flags: one frozen dataclass, validated once, carried to every process.

Each flag is declared once, as its field's metadata (``Flag``: name, help, kind, choices,
bounds, owning algorithm); the argparse group, the namespace reader, the declared checks and
``docs/flags.md`` are all built from those declarations.

SGLang's ``ServerArgs`` is never touched: ``launch_server`` strips our flags from argv before
SGLang parses it, and the validated config travels to spawned scheduler processes through one
environment variable (JSON), which ``SpecConfig.from_env`` reads back.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from dataclasses import Field, asdict, dataclass, field, fields

ENV_VAR = "SGLSPEC_CONFIG"
CPU_FALLBACK_CHOICES = ("auto", "on", "off")
MAX_MTP_K = 8
SPECBLOCK_BRANCHING_NAMES = {"default": (2, 4, 10, 0), "fallback": (2, 4, 6, 4)}  # App. A.5
MAX_SPECBLOCK_NODES = 256
SPECBLOCK_DEFAULT_M = 2  # tree blocks per iteration (paper §4.1 setting)
SPECBLOCK_DEFAULT_MAX_NODES = 32  # verified tree nodes per request
# On the shipped target + drafters (filled by ``model_defaults``): the node budget measured best
# on the CPU hosts (benchmarks/RESULTS.md), where a verified tree costs about linearly in its nodes.
SPECBLOCK_SHIPPED_MAX_NODES = 8
MINEDRAFT_DRAFTERS = ("model", "specblock")
MINEDRAFT_POLICIES = ("balanced", "paper")  # batch assignment (sgl_spec.minedraft.batch_manager)


class ConfigError(ValueError):
    """A bad sgl-spec flag; the message names the flag."""


@dataclass(frozen=True)
class Flag:
    """How one ``SpecConfig`` field appears on the command line (declared once, in the field's
    metadata; the parser, the namespace reader and ``docs/flags.md`` are built from it).

    ``kind``: ``str`` / ``int`` / ``float`` values, or ``"switch"`` (present sets the field to
    ``not default``); ``choices``: allowed values; ``bounds``: inclusive range of a number;
    ``requires``: the ``--speculative-algorithm`` the flag belongs to, when giving it with
    another algorithm is a mistake."""

    name: str
    help: str
    kind: type | str = str
    choices: tuple[str, ...] = ()
    bounds: tuple[float, float] | None = None
    requires: str | None = None


def flag(default: object, name: str, help: str, **options: object) -> object:
    return field(default=default, metadata={"flag": Flag(name, help, **options)})


def flag_of(f: Field) -> Flag:
    return f.metadata["flag"]


@dataclass(frozen=True)
class SpecConfig:
    cpu_defaults: str = flag(
        "auto",
        "--sgl-spec-cpu-defaults",
        "On a host without CUDA, add SGLang's CPU settings (--device cpu, CPU engine,"
        " intel_amx attention, overlap off) unless given: auto (default), on, off.",
        choices=CPU_FALLBACK_CHOICES,
    )
    cpu_lossless_sampling: bool = flag(
        True,
        "--sgl-spec-no-cpu-lossless-sampling",
        "Keep SGLang's CPU speculative verify, which commits argmax tokens even when"
        " sampling (not lossless); by default sgl-spec patches it to rejection sampling.",
        kind="switch",
    )
    standalone_full_context: bool = flag(
        True,
        "--sgl-spec-standalone-shifted-draft",
        "Keep SGLang's STANDALONE draft layout, which shifts the draft's input ids"
        " left by one and so drops token 0 from its context; by default sgl-spec patches"
        " the draft to see the whole sequence.",
        kind="switch",
    )
    mtp_lora_path: str | None = flag(
        None,
        "--mtp-lora-path",
        "MTP_LORA: directory of the gated-LoRA adapter (adapter_config.json +"
        " adapter.safetensors) or a shipped name such as sgl-spec/tiny-code-mtp.",
    )
    mtp_k: str | None = flag(
        None,
        "--mtp-k",
        "MTP_LORA: drafts per step (0 = no speculation), at most the adapter's k_max;"
        " 'auto' lets the speculation controller choose k per step from measured step times"
        " (and --mtp-gamma-table as a prior, if given) and the running acceptance.",
    )
    mtp_gamma_table: str | None = flag(
        None,
        "--mtp-gamma-table",
        "MTP_LORA with --mtp-k auto: optional prior, the JSON written by"
        " benchmarks/gamma_tolerance.py; served step times replace it once measured.",
    )
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
    speculative_draft_device: str | None = flag(
        None,
        "--speculative-draft-device",
        "MINEDRAFT: device of the draft-server process: cuda:N (a GPU of its own), or on"
        " a CPU host cpu:N (the last N cores, which the target then leaves alone) or cpu."
        " Default: the last GPU if there are two or more, else cpu:1.",
        requires="MINEDRAFT",
    )
    minedraft_drafter: str = flag(
        "model",
        "--minedraft-drafter",
        "MINEDRAFT: what the draft server hosts: 'model' (the draft LM of"
        " --speculative-draft-model-path) or 'specblock' (the SpecBlock drafter of"
        " --specblock-drafter-path, drafting chains of --speculative-num-steps; on the"
        " shipped target the shipped drafter).",
        choices=MINEDRAFT_DRAFTERS,
    )
    minedraft_policy: str = flag(
        "balanced",
        "--minedraft-policy",
        "MINEDRAFT: batch assignment, 'balanced' (every new request joins the smaller"
        " batch, App. A) or 'paper' (§5.1 as published).",
        choices=MINEDRAFT_POLICIES,
    )
    minedraft_draft_timeout: float = flag(
        30.0,
        "--minedraft-draft-timeout",
        "MINEDRAFT: seconds without a reply from the draft server, while drafts are awaited,"
        " before it is treated as hung and restarted (default 30); meanwhile a sync point"
        " waits at most a short budget, and its batch is decoded target-only.",
        kind=float,
        bounds=(1e-3, 86400.0),
    )
    minedraft_overlap: str = flag(
        "on",
        "--minedraft-overlap",
        "MINEDRAFT: 'on' (default) drafts one batch while the target verifies the other;"
        " 'off' runs every step as standard SD through the same draft server (draft, then"
        " verify): the like-for-like baseline that measures what the overlap gains.",
        choices=("on", "off"),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_declared(flag_of(f), getattr(self, f.name))
        if self.mtp_k is not None and self.mtp_k != "auto":
            if not self.mtp_k.isdigit() or not 0 <= int(self.mtp_k) <= MAX_MTP_K:
                raise ConfigError(
                    f"--mtp-k must be 'auto' or an integer in 0..{MAX_MTP_K}; got {self.mtp_k!r}"
                )
        specblock_bucket_map(self.specblock_branching)
        if self.specblock_adapt_options is not None:
            if not self.specblock_adapt:
                raise ConfigError("--specblock-adapt-options needs --specblock-adapt")
            from sgl_spec.specblock.adapt.policy import AdaptConfig

            try:
                AdaptConfig.parse(self.specblock_adapt_options)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"--specblock-adapt-options: {exc}") from None
        if self.speculative_draft_device is not None:
            from sgl_spec.minedraft.devices import parse_device

            try:
                parse_device(self.speculative_draft_device)
            except ValueError as exc:
                raise ConfigError(f"--speculative-draft-device: {exc}") from None

    @property
    def specblock_bucket_map(self) -> tuple[int, int, int, int]:
        return specblock_bucket_map(self.specblock_branching)

    def check_algorithm(self, algorithm: str | None) -> None:
        """Refuse a flag given (not at its default) for an algorithm other than its own."""
        for f in fields(self):
            spec = flag_of(f)
            if spec.requires and getattr(self, f.name) != f.default:
                if (algorithm or "").upper() != spec.requires:
                    raise ConfigError(f"{spec.name} needs --speculative-algorithm {spec.requires}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sgl-spec")
        for f in fields(SpecConfig):
            spec = flag_of(f)
            if spec.kind == "switch":
                group.add_argument(spec.name, dest=f.name, action="store_true", help=spec.help)
            else:
                group.add_argument(spec.name, dest=f.name, default=None, help=spec.help)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> SpecConfig:
        """Values the user gave, converted to each field's kind; the rest keep their default."""
        given = {}
        for f in fields(cls):
            spec, value = flag_of(f), getattr(ns, f.name)
            if spec.kind == "switch":
                if value:
                    given[f.name] = not f.default
            elif value is not None:
                given[f.name] = _convert(spec, value)
        return cls(**given)

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SpecConfig:
        """The config the launcher put in ``SGLSPEC_CONFIG`` (defaults when unset); read it
        through ``process_config`` in a served process, once."""
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        if not raw:
            return cls()
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"{ENV_VAR} has unknown keys: {sorted(unknown)}")
        return cls(**data)


@functools.cache
def process_config() -> SpecConfig:
    """This process's config: ``SGLSPEC_CONFIG`` read and validated once (the plugin entry point
    and the runtime patches share it; workers get settings built from it)."""
    return SpecConfig.from_env()


def _convert(spec: Flag, value: object) -> object:
    if spec.kind not in (int, float) or isinstance(value, spec.kind):
        return value
    try:
        return spec.kind(value)  # type: ignore[operator]
    except ValueError:
        noun = "an integer" if spec.kind is int else "a number"
        raise ConfigError(f"{spec.name} must be {noun}; got {value!r}") from None


def _check_declared(spec: Flag, value: object) -> None:
    """The checks a flag's declaration states: its choices and its bounds."""
    if value is None:
        return
    if spec.choices and value not in spec.choices:
        raise ConfigError(f"{spec.name} must be one of {', '.join(spec.choices)}; got {value!r}")
    if spec.bounds is not None:
        low, high = spec.bounds
        numeric = int if spec.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not low <= value <= high:
            noun = "an integer" if spec.kind is int else "a number"
            shown = f"{low:g}..{high:g}"
            raise ConfigError(f"{spec.name} must be {noun} in {shown}; got {value!r}")


def flags_markdown() -> str:
    """``docs/flags.md``: every sgl-spec flag, from the declarations above."""
    lines = [
        "# sgl-spec flags",
        "",
        "Generated from `sgl_spec/config.py` (`python -m sgl_spec.config > docs/flags.md`);"
        " every `sglang.launch_server` flag is accepted as well.",
        "",
        "| flag | default | values | for |",
        "| --- | --- | --- | --- |",
    ]
    for f in fields(SpecConfig):
        spec = flag_of(f)
        if spec.kind == "switch":
            values = "switch"
        elif spec.choices:
            values = " / ".join(spec.choices)
        elif spec.bounds is not None:
            values = f"{spec.kind.__name__} {spec.bounds[0]:g}..{spec.bounds[1]:g}"
        else:
            values = spec.kind.__name__ if isinstance(spec.kind, type) else str(spec.kind)
        first = spec.help.split(maxsplit=1)[0].rstrip(":")
        owner = spec.requires or (first if first.isupper() else "all")
        default = "off" if spec.kind == "switch" else f"`{f.default}`"
        lines.append(f"| `{spec.name}` | {default} | {values} | {owner} |")
    lines.append("")
    for f in fields(SpecConfig):
        spec = flag_of(f)
        lines += [f"- `{spec.name}`: {spec.help}"]
    return "\n".join(lines) + "\n"


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


def split_argv(argv: list[str]) -> tuple[SpecConfig, list[str]]:
    """Separate our flags from SGLang's; returns (validated config, argv for SGLang)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    SpecConfig.add_cli_args(parser)
    ns, rest = parser.parse_known_args(argv)
    return SpecConfig.from_namespace(ns), rest


if __name__ == "__main__":
    print(flags_markdown(), end="")
