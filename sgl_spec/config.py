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


class ConfigError(ValueError):
    """A bad sgl-spec flag; the message names the flag."""


@dataclass(frozen=True)
class SpecConfig:
    cpu_defaults: str = "auto"  # --sgl-spec-cpu-defaults: apply CPU-host SGLang settings
    cpu_lossless_sampling: bool = True  # --sgl-spec-no-cpu-lossless-sampling disables the patch

    def __post_init__(self) -> None:
        if self.cpu_defaults not in CPU_FALLBACK_CHOICES:
            raise ConfigError(
                f"--sgl-spec-cpu-defaults must be one of {', '.join(CPU_FALLBACK_CHOICES)};"
                f" got {self.cpu_defaults!r}"
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

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> SpecConfig:
        return cls(
            cpu_defaults=ns.sgl_spec_cpu_defaults,
            cpu_lossless_sampling=not ns.sgl_spec_no_cpu_lossless_sampling,
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
