"""Our command-line flags: one frozen dataclass, validated once, carried to every process.

``SpecConfig`` is assembled from flag groups: the core flags below and each algorithm's
``<package>/flags.py`` (``FLAGS``; the packages are listed in ``sgl_spec.algorithm_list``), so
an algorithm's flags, constants and checks live in its own folder. Each flag is declared once,
as its field's metadata (``sgl_spec.flags.Flag``); the argparse group, the namespace reader,
the declared checks and ``docs/flags.md`` are all built from those declarations, and each group's
``validate`` adds the checks a declaration cannot state.

SGLang's ``ServerArgs`` is never touched: ``launch_server`` strips our flags from argv before
SGLang parses it, and the validated config travels to spawned scheduler processes through one
environment variable (JSON), which ``SpecConfig.from_env`` reads back.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
from dataclasses import asdict, dataclass, fields

from sgl_spec.algorithm_list import EXTRA_ENV, packages
from sgl_spec.flags import ConfigError, Flag, check_declared, convert, flag, flag_of

__all__ = ["ENV_VAR", "ConfigError", "Flag", "SpecConfig", "process_config", "split_argv"]

ENV_VAR = "SGLSPEC_CONFIG"
CPU_FALLBACK_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class CoreFlags:
    """Flags of sgl-spec itself and of the SGLang behaviour it patches for every algorithm."""

    cpu_defaults: str = flag(
        "auto",
        "--sgl-spec-cpu-defaults",
        "On a host without CUDA, add SGLang's CPU settings (--device cpu, CPU engine,"
        " intel_amx attention, overlap off, sleep on idle) unless given: auto (default), on, off.",
        choices=CPU_FALLBACK_CHOICES,
    )
    cpu_lossless_sampling: bool = flag(
        True,
        "--sgl-spec-no-cpu-lossless-sampling",
        "Keep SGLang's CPU speculative verify, which commits argmax tokens even when"
        " sampling (not lossless); by default sgl-spec patches it to rejection sampling.",
        kind="switch",
    )

    def validate(self) -> None:
        """Nothing beyond the declared checks."""


def flag_groups() -> tuple[type, ...]:
    """The core group, then each algorithm's ``FLAGS`` in ``algorithm_list`` order."""
    return (CoreFlags, *(_import(f"{p}.flags").FLAGS for p in packages()))


def _import(module: str):
    """A module of an algorithm package; ``ConfigError`` naming the package otherwise."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"algorithm package {module.rpartition('.')[0]} (sgl_spec.algorithm_list or"
            f" {EXTRA_ENV}) cannot be imported: {exc}"
        ) from exc


class _ConfigMethods:
    """What ``SpecConfig`` does with its fields, whatever groups it is made of."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_declared(flag_of(f), getattr(self, f.name))
        for group in FLAG_GROUPS:
            if hasattr(group, "validate"):  # checks beyond the declared ones, if any
                group.validate(self)

    def check_algorithm(self, algorithm: str | None) -> None:
        """Refuse a flag given (not at its default) for an algorithm other than its own."""
        for f in fields(self):
            spec = flag_of(f)
            if spec.requires and getattr(self, f.name) != f.default:
                if (algorithm or "").upper() != spec.requires:
                    raise ConfigError(f"{spec.name} needs --speculative-algorithm {spec.requires}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sgl-spec")
        for f in fields(cls):
            spec = flag_of(f)
            if spec.kind == "internal":
                continue
            if spec.kind == "switch":
                group.add_argument(spec.name, dest=f.name, action="store_true", help=spec.help)
            else:
                group.add_argument(spec.name, dest=f.name, default=None, help=spec.help)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace):
        """Values the user gave, converted to each field's kind; the rest keep their default."""
        given = {}
        for f in fields(cls):
            spec = flag_of(f)
            if spec.kind == "internal":
                continue
            value = getattr(ns, f.name)
            if spec.kind == "switch":
                if value:
                    given[f.name] = not f.default
            elif value is not None:
                given[f.name] = convert(spec, value)
        return cls(**given)

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None):
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


def _assemble(groups: tuple[type, ...]) -> type:
    """The frozen dataclass of every group's fields, in ``groups`` order (a dataclass collects
    its bases' fields from the last base to the first)."""
    namespace = {
        "__module__": __name__,
        "__qualname__": "SpecConfig",
        "__doc__": "Every sgl-spec flag: the fields of each group of ``flag_groups``.",
    }
    return dataclass(frozen=True)(type("SpecConfig", (_ConfigMethods, *groups[::-1]), namespace))


FLAG_GROUPS = flag_groups()
SpecConfig = _assemble(FLAG_GROUPS)


@functools.cache
def process_config() -> SpecConfig:
    """This process's config: ``SGLSPEC_CONFIG`` read and validated once (the plugin entry point
    and the runtime patches share it; workers get settings built from it)."""
    return SpecConfig.from_env()


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
    shown = [f for f in fields(SpecConfig) if flag_of(f).kind != "internal"]
    for f in shown:
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
    for f in shown:
        spec = flag_of(f)
        lines += [f"- `{spec.name}`: {spec.help}"]
    return "\n".join(lines) + "\n"


def split_argv(argv: list[str]) -> tuple[SpecConfig, list[str]]:
    """Separate our flags from SGLang's; returns (validated config, argv for SGLang)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    SpecConfig.add_cli_args(parser)
    ns, rest = parser.parse_known_args(argv)
    return SpecConfig.from_namespace(ns), rest


if __name__ == "__main__":
    print(flags_markdown(), end="")
