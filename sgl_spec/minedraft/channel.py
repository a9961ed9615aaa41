"""Transport of the MineDraft messages: the IPC addresses of one scheduler <-> draft server
pair and the typed one-way ZMQ endpoint (``MessageChannel``) that sends and receives them as
frames (``codec.py``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from sgl_spec.minedraft.codec import decode, encode
from sgl_spec.minedraft.messages import Message


@dataclass(frozen=True)
class DraftServerAddresses:
    """The two one-way IPC sockets of one scheduler <-> draft server pair."""

    to_draft_server: str  # scheduler PUSH -> draft server PULL
    to_scheduler: str  # draft server PUSH -> scheduler PULL

    def socket_paths(self) -> tuple[str, str]:
        """The filesystem paths of the two ipc:// endpoints."""
        return tuple(a.removeprefix("ipc://") for a in (self.to_draft_server, self.to_scheduler))


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


def remove_socket_files(addresses: DraftServerAddresses) -> None:
    """Unlink the pair's IPC socket files. Once both ends are connected the paths are no longer
    needed (a Unix socket connection outlives its path), and libzmq leaves a bound ipc path in
    place when the socket closes, so a pair killed with its server would leave two files in the
    temp dir per launch."""
    for path in addresses.socket_paths():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


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
