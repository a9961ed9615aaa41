"""Our command-line flags: one frozen dataclass, validated once, carried to every process.

SGLang's ``ServerArgs`` is never touched: ``launch_server`` strips our flags from argv before
SGLang parses it, and the validated config travels to spawned scheduler processes through one
environment variable (JSON), which ``SpecConfig.from_env`` reads back.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, fields

ENV_VAR = "SGLSPEC_CONFIG"
CPU_FALLBACK_CHOICES = ("auto", "on", "off")
MAX_MTP_K = 8
SPECBLOCK_BRANCHING_NAMES = {"default": (2, 4, 10, 0), "fallback": (2, 4, 6, 4)}  # App. A.5
MAX_SPECBLOCK_NODES = 256
SPECBLOCK_DEFAULT_M = 2  # tree blocks per iteration (paper §4.1 setting)
SPECBLOCK_DEFAULT_MAX_NODES = 32  # verified tree nodes per request
# On the shipped target + drafters (filled by ``model_defaults``; benchmarks/RESULTS.md, session
# 12, 2-core CPU): a verified tree costs about linearly in its nodes here, and 8 nodes beat 16
# and 32 (0.70-0.80x / 0.59x / 0.45x of plain decoding at concurrency 1, K = 4 drafter).
SPECBLOCK_SHIPPED_MAX_NODES = 8
MINEDRAFT_DRAFTERS = ("model", "specblock")


class ConfigError(ValueError):
    """A bad sgl-spec flag; the message names the flag."""


@dataclass(frozen=True)
class SpecConfig:
    cpu_defaults: str = "auto"  # --sgl-spec-cpu-defaults: apply CPU-host SGLang settings
    cpu_lossless_sampling: bool = True  # --sgl-spec-no-cpu-lossless-sampling disables the patch
    # --sgl-spec-standalone-shifted-draft: keep EAGLE's shifted draft layout for STANDALONE
    standalone_full_context: bool = True
    mtp_lora_path: str | None = None  # --mtp-lora-path: gated-LoRA adapter dir for MTP_LORA
    mtp_k: str | None = None  # --mtp-k: drafts per step, an integer or "auto"
    mtp_gamma_table: str | None = None  # --mtp-gamma-table: gamma_tolerance.py JSON for auto
    specblock_drafter_path: str | None = None  # --specblock-drafter-path: drafter directory
    specblock_k: int | None = None  # --specblock-k: positions used per block (<= drafter's K)
    specblock_m: int = SPECBLOCK_DEFAULT_M  # --specblock-m: tree blocks per iteration
    specblock_branching: str = "default"  # --specblock-branching: App. A.5 bucket map
    # --specblock-max-nodes: verified tree nodes per request; None: SPECBLOCK_DEFAULT_MAX_NODES,
    # or SPECBLOCK_SHIPPED_MAX_NODES on the shipped target (``model_defaults``)
    specblock_max_nodes: int | None = None
    specblock_rank_head: str = "on"  # --specblock-rank-head: off = fixed top-2 trees
    specblock_adapt: bool = False  # --specblock-adapt: cost-aware online adaptation (§3.4)
    specblock_adapt_options: str | None = None  # --specblock-adapt-options: key=value,...
    speculative_draft_device: str | None = None  # --speculative-draft-device: MINEDRAFT drafter
    minedraft_drafter: str = "model"  # --minedraft-drafter: model (a draft LM) or specblock
    minedraft_policy: str = "balanced"  # --minedraft-policy: batch assignment (§5.1 / App. A)
    minedraft_draft_timeout: float = 30.0  # --minedraft-draft-timeout: seconds per sync point
    minedraft_overlap: str = "on"  # --minedraft-overlap: off = standard SD via the draft server

    def __post_init__(self) -> None:
        if self.cpu_defaults not in CPU_FALLBACK_CHOICES:
            raise ConfigError(
                f"--sgl-spec-cpu-defaults must be one of {', '.join(CPU_FALLBACK_CHOICES)};"
                f" got {self.cpu_defaults!r}"
            )
        if self.mtp_k is not None and self.mtp_k != "auto":
            if not self.mtp_k.isdigit() or not 0 <= int(self.mtp_k) <= MAX_MTP_K:
                raise ConfigError(
                    f"--mtp-k must be 'auto' or an integer in 0..{MAX_MTP_K}; got {self.mtp_k!r}"
                )
        self._check_specblock()
        self._check_minedraft()

    def _check_minedraft(self) -> None:
        if self.speculative_draft_device is not None:
            from sgl_spec.minedraft.draft_server import parse_device

            try:
                parse_device(self.speculative_draft_device)
            except ValueError as exc:
                raise ConfigError(f"--speculative-draft-device: {exc}") from None
        if self.minedraft_drafter not in MINEDRAFT_DRAFTERS:
            raise ConfigError(
                f"--minedraft-drafter must be one of {', '.join(MINEDRAFT_DRAFTERS)};"
                f" got {self.minedraft_drafter!r}"
            )
        from sgl_spec.minedraft.batch_manager import POLICIES

        if self.minedraft_policy not in POLICIES:
            raise ConfigError(
                f"--minedraft-policy must be one of {', '.join(POLICIES)};"
                f" got {self.minedraft_policy!r}"
            )
        if self.minedraft_overlap not in ("on", "off"):
            raise ConfigError(
                f"--minedraft-overlap must be 'on' or 'off'; got {self.minedraft_overlap!r}"
            )
        timeout = self.minedraft_draft_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ConfigError(f"--minedraft-draft-timeout must be > 0 seconds; got {timeout!r}")

    def _check_specblock(self) -> None:
        for flag, value, low, high in (
            ("--specblock-k", self.specblock_k, 1, 64),
            ("--specblock-m", self.specblock_m, 1, 16),
            ("--specblock-max-nodes", self.specblock_max_nodes, 2, MAX_SPECBLOCK_NODES),
        ):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{flag} must be an integer in {low}..{high}; got {value!r}")
        specblock_bucket_map(self.specblock_branching)
        if self.specblock_rank_head not in ("on", "off"):
            raise ConfigError(
                f"--specblock-rank-head must be 'on' or 'off'; got {self.specblock_rank_head!r}"
            )
        if self.specblock_adapt_options is not None:
            if not self.specblock_adapt:
                raise ConfigError("--specblock-adapt-options needs --specblock-adapt")
            from sgl_spec.specblock.adapt import AdaptConfig

            try:
                AdaptConfig.parse(self.specblock_adapt_options)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"--specblock-adapt-options: {exc}") from None

    @property
    def specblock_bucket_map(self) -> tuple[int, int, int, int]:
        return specblock_bucket_map(self.specblock_branching)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sgl-spec")
        group.add_argument(
            "--sgl-spec-cpu-defaults",
            dest="sgl_spec_cpu_defaults",
            default="auto",
            help="On a host without CUDA, add SGLang's CPU settings (--device cpu, CPU engine,"
            " intel_amx attention, overlap off) unless given: auto (default), on, off.",
        )
        group.add_argument(
            "--sgl-spec-no-cpu-lossless-sampling",
            dest="sgl_spec_no_cpu_lossless_sampling",
            action="store_true",
            help="Keep SGLang's CPU speculative verify, which commits argmax tokens even when"
            " sampling (not lossless); by default sgl-spec patches it to rejection sampling.",
        )
        group.add_argument(
            "--sgl-spec-standalone-shifted-draft",
            dest="sgl_spec_standalone_shifted_draft",
            action="store_true",
            help="Keep SGLang's STANDALONE draft layout, which shifts the draft's input ids"
            " left by one and so drops token 0 from its context; by default sgl-spec patches"
            " the draft to see the whole sequence.",
        )
        group.add_argument(
            "--mtp-lora-path",
            dest="mtp_lora_path",
            default=None,
            help="MTP_LORA: directory of the gated-LoRA adapter (adapter_config.json +"
            " adapter.safetensors) or a shipped name such as sgl-spec/tiny-code-mtp.",
        )
        group.add_argument(
            "--mtp-k",
            dest="mtp_k",
            default=None,
            help="MTP_LORA: drafts per step (0 = no speculation), at most the adapter's k_max;"
            " 'auto' lets the speculation controller choose k per step from measured step times"
            " (and --mtp-gamma-table as a prior, if given) and the running acceptance.",
        )
        group.add_argument(
            "--mtp-gamma-table",
            dest="mtp_gamma_table",
            default=None,
            help="MTP_LORA with --mtp-k auto: optional prior, the JSON written by"
            " benchmarks/gamma_tolerance.py; served step times replace it once measured.",
        )
        group.add_argument(
            "--specblock-drafter-path",
            dest="specblock_drafter_path",
            default=None,
            help="SPECBLOCK: drafter directory (config.json + model.safetensors written by"
            " `python -m sgl_spec.specblock.train`).",
        )
        group.add_argument(
            "--specblock-k",
            dest="specblock_k",
            default=None,
            help="SPECBLOCK: draft positions used per block, at most the drafter's trained K"
            " (default: its K).",
        )
        group.add_argument(
            "--specblock-m",
            dest="specblock_m",
            default=str(SPECBLOCK_DEFAULT_M),
            help="SPECBLOCK: tree blocks (batched drafter forwards) per iteration (default"
            f" {SPECBLOCK_DEFAULT_M}).",
        )
        group.add_argument(
            "--specblock-branching",
            dest="specblock_branching",
            default="default",
            help="SPECBLOCK: siblings per rank bucket b0..b3 (App. A.5): 'default' = 2,4,10,0,"
            " 'fallback' = 2,4,6,4, or four comma-separated integers.",
        )
        group.add_argument(
            "--specblock-max-nodes",
            dest="specblock_max_nodes",
            default=None,
            help="SPECBLOCK: tree nodes verified per request, root included (default"
            f" {SPECBLOCK_DEFAULT_MAX_NODES}; {SPECBLOCK_SHIPPED_MAX_NODES} on the shipped target,"
            " the measured best there).",
        )
        group.add_argument(
            "--specblock-rank-head",
            dest="specblock_rank_head",
            default="on",
            help="SPECBLOCK: 'on' (default) shapes the tree with the drafter's rank head"
            " (--specblock-branching); 'off' grows fixed trees instead, the top 2 tokens at"
            " every position and later blocks from chain ends only (the paper's Table 2"
            " ablation, at serving time).",
        )
        group.add_argument(
            "--specblock-adapt",
            dest="specblock_adapt",
            action="store_true",
            help="SPECBLOCK: cost-aware online adaptation of the drafter while serving (paper"
            " §3.4): a bandit picks skip / head-only / full updates from the verifier's signal;"
            " updates train a copy on a background thread. Off by default; outputs unchanged.",
        )
        group.add_argument(
            "--specblock-adapt-options",
            dest="specblock_adapt_options",
            default=None,
            help="SPECBLOCK with --specblock-adapt: override adaptation constants as"
            " key=value,... (fields of sgl_spec.specblock.adapt.AdaptConfig, e.g."
            " warmup_queries=10,measure_queries=8,buffer_queries=4,lr=3e-4).",
        )

        group.add_argument(
            "--speculative-draft-device",
            dest="speculative_draft_device",
            default=None,
            help="MINEDRAFT: device of the draft-server process: cuda:N (a GPU of its own), or on"
            " a CPU host cpu:N (the last N cores, which the target then leaves alone) or cpu."
            " Default: the last GPU if there are two or more, else cpu:1.",
        )
        group.add_argument(
            "--minedraft-drafter",
            dest="minedraft_drafter",
            default="model",
            help="MINEDRAFT: what the draft server hosts: 'model' (the draft LM of"
            " --speculative-draft-model-path) or 'specblock' (the SpecBlock drafter of"
            " --specblock-drafter-path, drafting chains of --speculative-num-steps; on the"
            " shipped target the shipped drafter).",
        )
        group.add_argument(
            "--minedraft-policy",
            dest="minedraft_policy",
            default="balanced",
            help="MINEDRAFT: batch assignment, 'balanced' (every new request joins the smaller"
            " batch, App. A) or 'paper' (§5.1 as published).",
        )
        group.add_argument(
            "--minedraft-draft-timeout",
            dest="minedraft_draft_timeout",
            default="30",
            help="MINEDRAFT: seconds to wait for the draft server at a sync point before it is"
            " treated as hung, restarted, and the step decoded target-only (default 30).",
        )
        group.add_argument(
            "--minedraft-overlap",
            dest="minedraft_overlap",
            default="on",
            help="MINEDRAFT: 'on' (default) drafts one batch while the target verifies the other;"
            " 'off' runs every step as standard SD through the same draft server (draft, then"
            " verify): the like-for-like baseline that measures what the overlap gains.",
        )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> SpecConfig:
        return cls(
            specblock_drafter_path=ns.specblock_drafter_path,
            specblock_k=_int_flag("--specblock-k", ns.specblock_k),
            specblock_m=_int_flag("--specblock-m", ns.specblock_m),
            specblock_branching=ns.specblock_branching,
            specblock_max_nodes=_int_flag("--specblock-max-nodes", ns.specblock_max_nodes),
            specblock_rank_head=ns.specblock_rank_head,
            specblock_adapt=ns.specblock_adapt,
            specblock_adapt_options=ns.specblock_adapt_options,
            cpu_defaults=ns.sgl_spec_cpu_defaults,
            cpu_lossless_sampling=not ns.sgl_spec_no_cpu_lossless_sampling,
            standalone_full_context=not ns.sgl_spec_standalone_shifted_draft,
            mtp_lora_path=ns.mtp_lora_path,
            mtp_k=ns.mtp_k,
            mtp_gamma_table=ns.mtp_gamma_table,
            speculative_draft_device=ns.speculative_draft_device,
            minedraft_drafter=ns.minedraft_drafter,
            minedraft_policy=ns.minedraft_policy,
            minedraft_draft_timeout=_float_flag(
                "--minedraft-draft-timeout", ns.minedraft_draft_timeout
            ),
            minedraft_overlap=ns.minedraft_overlap,
        )

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SpecConfig:
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        if not raw:
            return cls()
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"{ENV_VAR} has unknown keys: {sorted(unknown)}")
        return cls(**data)


def _int_flag(flag: str, value: str | int | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} must be an integer; got {value!r}") from None


def _float_flag(flag: str, value: str | float) -> float:
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag} must be a number; got {value!r}") from None


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
