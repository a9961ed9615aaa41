"""Wire format of the MineDraft messages (``messages.py``): one ZMQ frame per message::

    b"MD" | protocol version (uint16 LE) | type tag (uint8) | msgpack body (msgspec)

Token ids and probabilities travel as msgpack ext values holding raw little-endian int32 /
float32 data plus their shape, so a ``[bs, vocab]`` tensor costs its bytes, not a msgpack list.
``decode`` raises :class:`MessageError` on a foreign protocol version, an unknown type tag, a
truncated or malformed payload and values that violate a message's invariants, so a
misbehaving draft server can be detected and degraded to target-only decoding.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from sgl_spec.minedraft.messages import (
    PROTOCOL_VERSION,
    DraftRequest,
    DraftResult,
    ErrorReport,
    Hello,
    Message,
    MessageError,
    Ready,
    Shutdown,
)

_MAGIC = b"MD"
_HEADER = struct.Struct("<2sHB")  # magic, protocol version, type tag
_EXT_INT32 = 1
_EXT_FLOAT32 = 2
_MAX_NDIM = 4

# Wire tags are part of the protocol: never renumber, bump PROTOCOL_VERSION instead.
_TAGS: dict[type, int] = {
    Hello: 1,
    DraftRequest: 2,
    Shutdown: 3,
    Ready: 17,
    DraftResult: 18,
    ErrorReport: 19,
}


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
