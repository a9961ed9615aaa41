"""How an sgl-spec flag is declared: ``flag(...)`` as a dataclass field's default, its ``Flag``
in the field's metadata (name, help, kind, choices, bounds, owning algorithm).

Leaf module: the flag groups (``sgl_spec/config.py``'s core flags and each algorithm's
``<package>/flags.py``) declare their fields with it, and ``SpecConfig`` is assembled from them.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field


class ConfigError(ValueError):
    """A bad sgl-spec flag; the message names the flag."""


@dataclass(frozen=True)
class Flag:
    """How one ``SpecConfig`` field appears on the command line (declared once, in the field's
    metadata; the parser, the namespace reader and ``docs/flags.md`` are built from it).

    ``kind``: ``str`` / ``int`` / ``float`` values, ``"switch"`` (present sets the field to
    ``not default``), or ``"internal"`` (not on the command line: set by the launcher, carried
    to every process with the rest; ``name`` says what sets it); ``choices``: allowed values; ``bounds``: inclusive range of a number;
    ``requires``: the ``--speculative-algorithm`` the flag belongs to, when giving it with
    another algorithm is a mistake."""

    name: str
    help: str
    kind: type | str = str
    choices: tuple[str, ...] = ()
    bounds: tuple[float, float] | None = None
    requires: str | None = None


# Who names each step's chain length (``sgl_spec.control.chain_steps.ChainSteps``): the choices
# of every such flag (``--standalone-steps``, ``--minedraft-steps``).
CHAIN_STEPS_MODES = ("fixed", "auto", "cycle", "off")


def flag(default: object, name: str, help: str, **options: object) -> object:
    return field(default=default, metadata={"flag": Flag(name, help, **options)})


def flag_of(f: Field) -> Flag:
    return f.metadata["flag"]


def convert(spec: Flag, value: object) -> object:
    """A command-line string as the flag's kind (int / float); other values as given."""
    if spec.kind not in (int, float) or isinstance(value, spec.kind):
        return value
    try:
        return spec.kind(value)  # type: ignore[operator]
    except ValueError:
        noun = "an integer" if spec.kind is int else "a number"
        raise ConfigError(f"{spec.name} must be {noun}; got {value!r}") from None


def check_declared(spec: Flag, value: object) -> None:
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
