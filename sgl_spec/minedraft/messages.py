"""Messages between the target's scheduler process and the MineDraft draft-server process.

MineDraft (paper §5, Fig. 2) runs the Drafter on its own device in its own process so that
drafting batch B overlaps verification of batch A. Each SD step the scheduler sends the draft
server one :class:`DraftRequest` (the tokens verified since the last message, §5.2 "the Verifier
returns the sampled tokens ... to the Drafter") and gets back one :class:`DraftResult` at the
sync point. Every message is a frozen dataclass, grouped below by receiver.

Wire format (one ZMQ frame per message)::

    b"MD" | protocol version (uint16 LE) | type tag (uint8) | msgpack body (msgspec)

Token ids and probabilities travel as msgpack ext values holding raw little-endian int32 /
float32 data plus their shape, so a ``[bs, vocab]`` tensor costs its bytes, not a msgpack list.
Array fields accept numpy arrays, torch tensors or int sequences and are stored as numpy arrays
(``torch.from_numpy`` gives a tensor back without a copy); the dataclasses therefore use
identity equality. ``decode`` raises :class:`MessageError` on a foreign protocol version, an
unknown type tag, a truncated or malformed payload and values that violate a message's
invariants, so a misbehaving draft server can be detected and degraded to target-only decoding.
"""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

PROTOCOL_VERSION = 3  # 2: Hello.max_total_tokens; 3: Hello.drafter, DraftEntry.features
_MAGIC = b"MD"
_HEADER = struct.Struct("<2sHB")  # magic, protocol version, type tag
_EXT_INT32 = 1
_EXT_FLOAT32 = 2
_MAX_NDIM = 4


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

# Wire tags are part of the protocol: never renumber, bump PROTOCOL_VERSION instead.
_TAGS: dict[type, int] = {
    Hello: 1,
    DraftRequest: 2,
    Shutdown: 3,
    Ready: 17,
    DraftResult: 18,
    ErrorReport: 19,
}


# ---------------------------------------------------------------------------------------------
# encode / decode
# ---------------------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.ndim > _MAX_NDIM:
            raise MessageError(f"arrays of more than {_MAX_NDIM} dimensions: {obj.shape}")
        code, wire = (_EXT_FLOAT32, "<f4") if obj.dtype == np.float32 else (_EXT_INT32, "<i4")
        header = struct.pack(f"<B{obj.ndim}I", obj.ndim, *obj.shape)
        return msgspec.msgpack.Ext(code, header + obj.astype(wire, copy=False).tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> np.ndarray:
    if code not in (_EXT_INT32, _EXT_FLOAT32) or len(data) < 1:
        raise MessageError(f"unknown array encoding (ext code {code})")
    ndim = data[0]
    if ndim > _MAX_NDIM or len(data) < 1 + 4 * ndim:
        raise MessageError("truncated or malformed array header")
    shape = struct.unpack_from(f"<{ndim}I", data, 1)
    wire, native = ("<f4", np.float32) if code == _EXT_FLOAT32 else ("<i4", np.int32)
    body = data[1 + 4 * ndim :]
    if len(body) != 4 * int(np.prod(shape, dtype=np.int64)):
        raise MessageError(f"array payload of {len(body)} bytes does not match shape {shape}")
    return np.frombuffer(body, dtype=wire).astype(native).reshape(shape)


def _dec_hook(expected: type, obj: Any) -> Any:
    if expected is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise MessageError(f"expected {expected.__name__}, got {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODERS = {
    tag: (cls, msgspec.msgpack.Decoder(cls, dec_hook=_dec_hook, ext_hook=_ext_hook))
    for cls, tag in _TAGS.items()
}


def encode(msg: Message) -> bytes:
    """Serialise one message into one frame (header + msgpack body)."""
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise MessageError(f"not a message type: {type(msg).__name__}")
    return _HEADER.pack(_MAGIC, PROTOCOL_VERSION, tag) + _ENCODER.encode(msg)


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Parse one frame; raises MessageError for anything but a valid message of this version."""
    if len(frame) < _HEADER.size:
        raise MessageError(f"truncated frame: {len(frame)} bytes, header needs {_HEADER.size}")
    magic, version, tag = _HEADER.unpack_from(frame)
    if magic != _MAGIC:
        raise MessageError(f"not a MineDraft message (magic {bytes(magic)!r})")
    if version != PROTOCOL_VERSION:
        raise MessageError(
            f"protocol version {version}, expected {PROTOCOL_VERSION}: the draft server and"
            " the scheduler come from different sgl-spec versions"
        )
    if tag not in _DECODERS:
        raise MessageError(f"unknown message type tag {tag}")
    cls, decoder = _DECODERS[tag]
    try:
        return decoder.decode(memoryview(frame)[_HEADER.size :])
    except MessageError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise MessageError(f"bad {cls.__name__} payload: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# transport
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftServerAddresses:
    """The two one-way IPC sockets of one scheduler <-> draft server pair."""

    to_draft_server: str  # scheduler PUSH -> draft server PULL
    to_scheduler: str  # draft server PUSH -> scheduler PULL


_MAX_IPC_PATH = 100  # sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS)


def draft_server_addresses(instance_id: str, ipc_dir: str | None = None) -> DraftServerAddresses:
    """Derive the socket addresses of one draft server (the only place they are built).

    ``instance_id`` must be unique per scheduler process on the host, e.g. the server port and
    DP rank (``f"{port}-dp{dp_rank}"``); both processes call this with the same arguments.
    """
    if not instance_id or not all(c.isalnum() or c in "-_." for c in instance_id):
        raise ValueError(f"instance_id must be non-empty [A-Za-z0-9._-], got {instance_id!r}")
    base = os.path.join(ipc_dir or tempfile.gettempdir(), f"sgl-spec-minedraft-{instance_id}")
    if len(base) + len("-to-scheduler") > _MAX_IPC_PATH:
        raise ValueError(f"IPC path too long for a unix socket: {base!r}; pass a shorter ipc_dir")
    return DraftServerAddresses(
        to_draft_server=f"ipc://{base}-to-draft", to_scheduler=f"ipc://{base}-to-scheduler"
    )


class MessageChannel:
    """One typed, one-directional ZMQ endpoint: PUSH to ``send`` or PULL to ``recv``.

    Built with SGLang's ``get_zmq_socket`` so buffer sizes and TCP peer restrictions match the
    rest of the server. ``recv`` raises MessageError on a bad frame (the frame is consumed).
    """

    def __init__(self, endpoint: str, socket_type: int, *, bind: bool, context: Any = None):
        import zmq
        from sglang.srt.utils.network import get_zmq_socket  # heavy import: only when used

        if socket_type not in (zmq.PUSH, zmq.PULL):
            raise ValueError("MessageChannel is one-directional: zmq.PUSH or zmq.PULL")
        self._zmq = zmq
        self.endpoint = endpoint
        self._socket = get_zmq_socket(
            context or zmq.Context.instance(), socket_type, endpoint, bind=bind
        )
        self._socket.setsockopt(zmq.LINGER, 0)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    def send(self, msg: Message) -> None:
        self._socket.send(encode(msg), copy=False)

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next message, or None if none arrives within ``timeout_s`` (None: wait forever)."""
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self._poller.poll(timeout_ms):
            return None
        return decode(self._socket.recv(copy=False).buffer)

    def close(self, linger_s: float = 0.0) -> None:
        """Close; ``linger_s`` bounds how long queued outgoing messages may still be sent."""
        if not self._socket.closed:
            self._poller.unregister(self._socket)
            self._socket.close(linger=int(linger_s * 1000))

    def __enter__(self) -> MessageChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "PROTOCOL_VERSION",
    "DraftEntry",
    "DraftOutput",
    "DraftRequest",
    "DraftResult",
    "DraftServerAddresses",
    "ErrorReport",
    "Hello",
    "Message",
    "MessageChannel",
    "MessageError",
    "Ready",
    "Shutdown",
    "ToDraftServer",
    "ToScheduler",
    "decode",
    "draft_server_addresses",
    "encode",
]
