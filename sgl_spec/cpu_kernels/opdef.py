"""``OpDef``: one op of the fallback library, as each op module declares it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class OpDef:
    name: str
    schema: str  # "(Tensor a, ...) -> ()" without the name
    impl: Callable[..., object]
