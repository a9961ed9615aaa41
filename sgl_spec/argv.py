"""Reading and editing SGLang-style command lines (``--name value`` or ``--name=value``).

One implementation for the launcher, the model defaults and the benchmark harness. Like
argparse, the last occurrence of a flag is the one that counts.
"""

from __future__ import annotations


def has_flag(argv: list[str], *names: str) -> bool:
    return any(arg == n or arg.startswith(n + "=") for arg in argv for n in names)


def _last_index(argv: list[str], name: str) -> int | None:
    found = None
    for i, arg in enumerate(argv):
        if (arg == name and i + 1 < len(argv)) or arg.startswith(name + "="):
            found = i
    return found


def flag_value(argv: list[str], name: str) -> str | None:
    """Last value of ``name`` in ``argv``, or None."""
    i = _last_index(argv, name)
    if i is None:
        return None
    return argv[i + 1] if argv[i] == name else argv[i].split("=", 1)[1]


def set_flag_value(argv: list[str], name: str, value: str) -> list[str]:
    """``argv`` with the effective value of ``name`` replaced, or ``name value`` appended."""
    out = list(argv)
    i = _last_index(out, name)
    if i is None:
        return out + [name, value]
    if out[i] == name:
        out[i + 1] = value
    else:
        out[i] = f"{name}={value}"
    return out
