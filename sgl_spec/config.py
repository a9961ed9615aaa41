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


class ConfigError(ValueError):
    """A bad sgl-spec flag; the message names the flag."""


@dataclass(frozen=True)
class SpecConfig:
    cpu_defaults: str = "auto"  # --sgl-spec-cpu-defaults: apply CPU-host SGLang settings
    cpu_lossless_sampling: bool = True  # --sgl-spec-no-cpu-lossless-sampling disables the patch
    mtp_lora_path: str | None = None  # --mtp-lora-path: gated-LoRA adapter dir for MTP_LORA
    mtp_k: str | None = None  # --mtp-k: drafts per step, an integer or "auto"
    mtp_gamma_table: str | None = None  # --mtp-gamma-table: gamma_tolerance.py JSON for auto

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

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> SpecConfig:
        return cls(
            cpu_defaults=ns.sgl_spec_cpu_defaults,
            cpu_lossless_sampling=not ns.sgl_spec_no_cpu_lossless_sampling,
            mtp_lora_path=ns.mtp_lora_path,
            mtp_k=ns.mtp_k,
            mtp_gamma_table=ns.mtp_gamma_table,
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


def split_argv(argv: list[str]) -> tuple[SpecConfig, list[str]]:
    """Separate our flags from SGLang's; returns (validated config, argv for SGLang)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    SpecConfig.add_cli_args(parser)
    ns, rest = parser.parse_known_args(argv)
    return SpecConfig.from_namespace(ns), rest
