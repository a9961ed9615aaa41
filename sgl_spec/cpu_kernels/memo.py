"""What one op call derived from its index tensors, kept for the next call that passes the same.

Every decoder layer of a forward calls the attention and rotary ops with SGLang's same
``req_to_token`` / ``req_pool_indices`` / ``seq_lens`` / ``positions`` tensors, so the pool rows,
masks and cos/sin those determine are the same for all layers. At decode sizes building them
costs more than the attention itself (tens of small ops per call), so they are built once per
forward and reused by the later layers.

A hit needs the very same tensor objects *and* the same contents: small index tensors are
compared with a copy taken when the entry was built (SGLang may refill one buffer in place
between forwards, as its CPU graph runner does), and a large one (``req_to_token``) by its
version counter, which every in-place write bumps, in inference mode too. A tensor without a
version counter (an inference tensor) is compared by content as well. Entries are per thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None


@dataclass
class _Entry:
    small: tuple[torch.Tensor | None, ...]
    copies: tuple[torch.Tensor | None, ...]
    large: tuple[torch.Tensor, ...]
    versions: tuple[int | None, ...]
    extra: tuple
    value: object

    def matches(
        self,
        small: tuple[torch.Tensor | None, ...],
        large: tuple[torch.Tensor, ...],
        versions: tuple[int | None, ...],
        extra: tuple,
    ) -> bool:
        if extra != self.extra or versions != self.versions:
            return False
        if len(small) != len(self.small) or len(large) != len(self.large):
            return False
        if any(a is not b for a, b in zip(large, self.large, strict=True)):
            return False
        for t, kept, copy in zip(small, self.small, self.copies, strict=True):
            if t is not kept:
                return False
            if t is not None and not torch.equal(t, copy):
                return False
        return True


class LastCall(Generic[T]):
    """One remembered entry per thread: the value built from the last distinct inputs."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(
        self,
        small: tuple[torch.Tensor | None, ...],  # compared by identity and content
        large: tuple[torch.Tensor, ...],  # compared by identity and version counter
        extra: tuple,  # plain values (scalars, flags)
        build: Callable[[], T],
    ) -> T:
        """The value for these inputs: the remembered one if they match, else ``build()``."""
        versions = tuple(_version(t) for t in large)
        if None in versions:  # no version counter: compare those by content too
            small, large, versions = small + large, (), ()
        entry: _Entry | None = getattr(self._local, "entry", None)
        if entry is not None and entry.matches(small, large, versions, extra):
            return entry.value  # type: ignore[return-value]
        value = build()
        copies = tuple(None if t is None else t.clone() for t in small)
        self._local.entry = _Entry(small, copies, large, versions, extra, value)
        return value
