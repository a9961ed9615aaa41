"""Messages between the target's scheduler process and the MineDraft draft-server process.

MineDraft (paper §5, Fig. 2) runs the Drafter on its own device in its own process so that
drafting batch B overlaps verification of batch A. Each SD step the scheduler sends the draft
server one :class:`DraftRequest` (the tokens verified since the last message, §5.2 "the Verifier
returns the sampled tokens ... to the Drafter") and gets back one :class:`DraftResult` at the
sync point. Every message is a frozen dataclass, grouped below by receiver; this module holds
their definitions and invariants only. ``codec.py`` turns them into frames and back,
``channel.py`` carries the frames over ZMQ.

Array fields accept numpy arrays, torch tensors or int sequences and are stored as numpy arrays
(``torch.from_numpy`` gives a tensor back without a copy); the dataclasses therefore use
identity equality. Construction raises :class:`MessageError` on values that violate a message's
invariants, so a decoded frame from a misbehaving draft server fails the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PROTOCOL_VERSION = 3  # 2: Hello.max_total_tokens; 3: Hello.drafter, DraftEntry.features


class MessageError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _as_array(value: Any, dtype: type, ndim: int | None, what: str) -> np.ndarray:
    """Normalise a numpy array / torch tensor / sequence to a contiguous ``dtype`` array."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch here
        value = value.detach().cpu()
        value = value.float() if dtype is np.float32 else value.int()
        value = value.numpy()
    array = np.ascontiguousarray(value, dtype=dtype)
    if ndim is not None and array.ndim != ndim:
        raise MessageError(f"{what} must have {ndim} dimension(s), got shape {array.shape}")
    return array


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


# ---------------------------------------------------------------------------------------------
# Scheduler -> draft server
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Hello:
    """Handshake: the draft server loads ``draft_model_path`` on ``device`` and answers Ready."""

    draft_model_path: str
    device: str  # "cuda:1", "cpu", "cpu:1" (own core set)
    num_steps: int  # draft tokens per request per step (chain length)
    num_draft_tokens: int
    topk: int
    max_batch_size: int  # requests per batch (the paper's N); the server holds up to 2N
    seed: int = 0
    # The target's KV budget in tokens (--max-total-tokens), 0 if SGLang sizes it from memory:
    # the draft server never holds more verified tokens than the target, so this bounds its pool.
    max_total_tokens: int = 0
    # "model": a draft LM at draft_model_path; "specblock": a SpecBlock drafter directory there,
    # fed the target's features with each DraftEntry (--minedraft-drafter).
    drafter: str = "model"

    def __post_init__(self) -> None:
        for name in ("num_steps", "num_draft_tokens", "topk", "max_batch_size"):
            if getattr(self, name) < 1:
                raise MessageError(f"Hello.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens < 0:
            raise MessageError(f"Hello.max_total_tokens must be >= 0, got {self.max_total_tokens}")
        if self.drafter not in ("model", "specblock"):
            raise MessageError(
                f"Hello.drafter must be 'model' or 'specblock', got {self.drafter!r}"
            )


@dataclass(frozen=True, eq=False)
class DraftEntry:
    """One request of the batch to draft in this step.

    ``appended_ids`` are the tokens verified since this request was last sent (accepted drafts
    plus the bonus token; variable length, possibly empty). ``seq_len`` is the request's total
    length after appending them, so the server can detect a lost or duplicated update.
    ``prompt_ids`` is set only on the request's first entry; the server then starts a new
    sequence ``prompt_ids + appended_ids``. ``temperature`` 0 drafts greedily (no probs).
    ``features`` (SpecBlock drafter only) are the target's (low, mid, top) feature rows of the
    positions that gained them since the last entry: every token but the newest one has them.
    """

    rid: str
    appended_ids: np.ndarray  # [num_appended] int32
    seq_len: int
    prompt_ids: np.ndarray | None = None  # [prompt_len] int32, first entry only
    temperature: float = 0.0
    features: np.ndarray | None = None  # [num_rows, 3 * d_target] float32

    def __post_init__(self) -> None:
        _set(self, "appended_ids", _as_array(self.appended_ids, np.int32, 1, "appended_ids"))
        if self.prompt_ids is not None:
            _set(self, "prompt_ids", _as_array(self.prompt_ids, np.int32, 1, "prompt_ids"))
        if self.features is not None:
            rows = _as_array(self.features, np.float32, 2, "features")
            if len(rows) > self.seq_len:
                raise MessageError(
                    f"{self.rid}: {len(rows)} feature rows for a sequence of {self.seq_len}"
                )
            _set(self, "features", rows)
        known = len(self.appended_ids) + (0 if self.prompt_ids is None else len(self.prompt_ids))
        if self.seq_len < known:
            raise MessageError(f"{self.rid}: seq_len {self.seq_len} < {known} tokens sent")
        if self.temperature < 0:
            raise MessageError(f"{self.rid}: temperature must be >= 0, got {self.temperature}")

    @property
    def is_new(self) -> bool:
        return self.prompt_ids is not None


@dataclass(frozen=True, eq=False)
class DraftRequest:
    """Draft ``entries`` (the draft batch ``batch_id`` of SD step ``step_id``, §5.2).

    ``removed_rids`` are requests that finished, were aborted or preempted (the batch manager's
    recycle, §5.1); the server frees their draft KV before drafting.
    """

    step_id: int
    batch_id: int
    entries: tuple[DraftEntry, ...] = ()
    removed_rids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _set(self, "entries", tuple(self.entries))
        _set(self, "removed_rids", tuple(self.removed_rids))
        if self.batch_id not in (0, 1):
            raise MessageError(f"batch_id must be 0 or 1, got {self.batch_id}")
        rids = [e.rid for e in self.entries]
        if len(set(rids)) != len(rids):
            raise MessageError(f"step {self.step_id}: duplicate rids in entries")


@dataclass(frozen=True, eq=False)
class Shutdown:
    """Ask the draft server to exit cleanly."""

    reason: str = ""


# ---------------------------------------------------------------------------------------------
# Draft server -> scheduler
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Ready:
    """Answer to Hello once the draft model is loaded: the draft server is serving."""

    pid: int
    device: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, eq=False)
class DraftOutput:
    """Draft tokens for one request; ``draft_probs`` (draft distribution q per drafted
    position, needed by rejection sampling) only when the request samples."""

    rid: str
    draft_ids: np.ndarray  # [num_steps] int32
    draft_probs: np.ndarray | None = None  # [num_steps, vocab] float32

    def __post_init__(self) -> None:
        _set(self, "draft_ids", _as_array(self.draft_ids, np.int32, 1, "draft_ids"))
        if self.draft_probs is not None:
            probs = _as_array(self.draft_probs, np.float32, 2, "draft_probs")
            if probs.shape[0] != len(self.draft_ids):
                raise MessageError(
                    f"{self.rid}: draft_probs has {probs.shape[0]} rows for"
                    f" {len(self.draft_ids)} draft tokens"
                )
            _set(self, "draft_probs", probs)


@dataclass(frozen=True, eq=False)
class DraftResult:
    """Drafts for the batch of DraftRequest ``step_id`` (returned at the sync point, §5.2)."""

    step_id: int
    batch_id: int
    outputs: tuple[DraftOutput, ...] = ()
    draft_time_s: float = 0.0  # wall time the server spent drafting (metrics)

    def __post_init__(self) -> None:
        _set(self, "outputs", tuple(self.outputs))
        if self.batch_id not in (0, 1):
            raise MessageError(f"batch_id must be 0 or 1, got {self.batch_id}")

    def by_rid(self) -> dict[str, DraftOutput]:
        return {o.rid: o for o in self.outputs}


@dataclass(frozen=True, eq=False)
class ErrorReport:
    """The draft server could not serve a message. ``fatal``: it is exiting; otherwise it
    dropped the listed ``rids`` (e.g. seq_len mismatch) and expects them re-sent with prompts."""

    message: str
    step_id: int = -1
    rids: tuple[str, ...] = ()
    fatal: bool = False

    def __post_init__(self) -> None:
        _set(self, "rids", tuple(self.rids))


ToDraftServer = Hello | DraftRequest | Shutdown
ToScheduler = Ready | DraftResult | ErrorReport
Message = ToDraftServer | ToScheduler


__all__ = [
    "PROTOCOL_VERSION",
    "DraftEntry",
    "DraftOutput",
    "DraftRequest",
    "DraftResult",
    "ErrorReport",
    "Hello",
    "Message",
    "MessageError",
    "Ready",
    "Shutdown",
    "ToDraftServer",
    "ToScheduler",
]
