"""Scheduler side of the MineDraft draft server: spawn it, handshake, submit / collect.

One ``DraftServerClient`` per scheduler process owns one draft-server process
(``draft_server.py``, started with ``python -m`` so it shares nothing with the scheduler but the
two IPC sockets). Every call is bounded in time: ``start`` by the handshake timeout, ``collect``
by its argument, ``submit`` never blocks (the scheduler connects its sending socket, so messages
queue even while the server is down), ``close`` by the grace period. Anything that goes wrong
-- the process exiting, a fatal ``ErrorReport``, a malformed frame, no ``Ready`` in time --
raises :class:`DraftServerError`, which the scheduler turns into target-only decoding (DESIGN:
"a failing drafter never fails a request") and may follow with ``restart()``.

A restarted server holds no sequences: the scheduler re-sends every request with its prompt
(``generation`` counts the starts so it can tell).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from sgl_spec.minedraft.channel import (
    MessageChannel,
    draft_server_addresses,
    remove_socket_files,
)
from sgl_spec.minedraft.messages import (
    PROTOCOL_VERSION,
    DraftRequest,
    DraftResult,
    ErrorReport,
    Hello,
    MessageError,
    Ready,
    Shutdown,
)

POLL_S = 0.2


class DraftServerError(RuntimeError):
    """The draft server cannot serve: failed start, exit, fatal report or malformed reply."""


def check_hello(hello: Hello) -> None:
    """Refuse, before spawning anything, a Hello the draft server would refuse after a slow
    start-up: unknown device syntax, tree drafting, a model path that does not exist."""
    from sgl_spec.minedraft.devices import parse_device
    from sgl_spec.models.registry import resolve_model_path

    try:
        parse_device(hello.device)
        resolve_model_path(hello.draft_model_path)
    except ValueError as exc:
        raise DraftServerError(f"MineDraft draft server: {exc}") from exc
    if hello.topk != 1:
        raise DraftServerError(
            f"MineDraft draft server: topk {hello.topk}, only chain drafts (topk 1) are served"
        )


def draft_server_env(device: str, base: Mapping[str, str]) -> dict[str, str]:
    """The draft server's environment. A CPU draft server also hides the GPUs: SGLang decides
    CUDA or CPU once per process, when it is imported (``is_cuda()`` in module globals), so on a
    GPU host a CPU draft would otherwise run CUDA-only kernels on CPU tensors."""
    env = {**base, "PYTHONUNBUFFERED": "1"}
    if device.startswith("cpu"):
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # read when sglang is imported, before Hello
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return ""
    return "\n".join(line[:300] for line in lines)


class DraftServerClient:
    """Owns one draft-server process and its two channels (see the module docstring)."""

    def __init__(
        self,
        hello: Hello,
        instance_id: str,
        *,
        ipc_dir: str | None = None,
        handshake_timeout_s: float = 300.0,
        shutdown_grace_s: float = 5.0,
        log_path: str | Path | None = None,
        cpu_affinity: list[int] | None = None,
    ) -> None:
        self.hello = hello
        self.instance_id = instance_id
        self.ipc_dir = ipc_dir
        self.addresses = draft_server_addresses(instance_id, ipc_dir)  # validates the id
        self.handshake_timeout_s = handshake_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.log_path = Path(
            log_path
            or Path(ipc_dir or tempfile.gettempdir()) / f"sgl-spec-minedraft-{instance_id}.log"
        )
        self.ready: Ready | None = None
        self.generation = 0  # number of successful starts
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._inbox: MessageChannel | None = None
        self._outbox: MessageChannel | None = None
        self._fatal: str | None = None
        self._errors: list[ErrorReport] = []
        self.num_stale = 0  # DraftResults discarded by collect(step_id=...)
        # Cores the process starts on (a ``cpu:N`` server takes the last N of them); default:
        # this process's affinity at spawn time.
        self.cpu_affinity = None if cpu_affinity is None else sorted(cpu_affinity)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> Ready:
        """Spawn the process and wait for Ready; raises DraftServerError (process stopped)."""
        if self._proc is not None:
            raise DraftServerError("draft server already started; use restart()")
        check_hello(self.hello)
        import zmq

        self._fatal = None
        self._errors.clear()
        self.ready = None
        self._outbox = MessageChannel(self.addresses.to_draft_server, zmq.PUSH, bind=False)
        self._inbox = MessageChannel(self.addresses.to_scheduler, zmq.PULL, bind=True)
        cmd = [sys.executable, "-m", "sgl_spec.minedraft.draft_server"]
        cmd += ["--instance-id", self.instance_id, "--parent-pid", str(os.getpid())]
        if self.ipc_dir:
            cmd += ["--ipc-dir", self.ipc_dir]
        env = draft_server_env(self.hello.device, os.environ)
        self._log = open(self.log_path, "w")
        self._proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=self._spawn_affinity(),
        )
        self._outbox.send(self.hello)
        try:
            self.ready = self._handshake()
        except BaseException:
            self._stop(graceful=False)
            raise
        remove_socket_files(self.addresses)  # both ends connected: Hello and Ready went through
        self.generation += 1
        return self.ready

    def _spawn_affinity(self):
        cores = self.cpu_affinity
        if not cores or not hasattr(os, "sched_setaffinity"):
            return None
        return lambda: os.sched_setaffinity(0, cores)

    def _handshake(self) -> Ready:
        deadline = time.monotonic() + self.handshake_timeout_s
        what = f"draft server for {self.hello.draft_model_path!r} on {self.hello.device}"
        while True:
            msg = self._recv(POLL_S)
            if isinstance(msg, Ready):
                if msg.version != PROTOCOL_VERSION:
                    raise DraftServerError(f"{what}: protocol version {msg.version}")
                return msg
            if isinstance(msg, ErrorReport):
                if msg.fatal:
                    raise DraftServerError(f"{what} failed to start: {msg.message}")
                self._errors.append(msg)
            elif msg is not None:
                raise DraftServerError(f"{what}: expected Ready, got {type(msg).__name__}")
            elif self._proc.poll() is not None:
                raise DraftServerError(
                    f"{what} exited with code {self._proc.returncode} before Ready"
                    f" (log {self.log_path}):\n{_tail(self.log_path)}"
                )
            elif time.monotonic() > deadline:
                raise DraftServerError(
                    f"{what}: no Ready within {self.handshake_timeout_s:.1f}s"
                    f" (log {self.log_path}):\n{_tail(self.log_path)}"
                )

    def alive(self) -> bool:
        """The process runs and has reported no fatal error."""
        return self._proc is not None and self._proc.poll() is None and self._fatal is None

    def restart(self) -> Ready:
        """Stop the current process (if any) and start a fresh one holding no sequences."""
        self.close()
        return self.start()

    def close(self) -> None:
        """Shutdown, then kill after ``shutdown_grace_s``; idempotent, never raises."""
        self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if graceful and self._outbox is not None:
                try:
                    self._outbox.send(Shutdown(reason="client close"))
                    proc.wait(timeout=self.shutdown_grace_s)
                except (subprocess.TimeoutExpired, OSError, MessageError):
                    pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for channel in (self._inbox, self._outbox):
            if channel is not None:
                channel.close()
        self._inbox = self._outbox = None
        remove_socket_files(self.addresses)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> DraftServerClient:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steps -------------------------------------------------------------------------------

    def submit(self, request: DraftRequest) -> None:
        """Queue one DraftRequest (never blocks); raises DraftServerError if the server is down."""
        self._check_alive()
        self._outbox.send(request)

    def collect(self, timeout_s: float, step_id: int | None = None) -> DraftResult | None:
        """The next DraftResult, or None if none arrives within ``timeout_s``.

        Results come in submit order. With ``step_id``, results of other steps (late answers to
        steps the caller already gave up on) are discarded and counted in ``num_stale``.
        Non-fatal ErrorReports that arrive meanwhile are kept for ``take_errors``; a fatal one,
        a malformed frame or the process's exit raise DraftServerError.
        """
        if self._inbox is None:
            raise DraftServerError("draft server not started")
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._recv(max(0.0, min(POLL_S, deadline - time.monotonic())))
            if isinstance(msg, DraftResult):
                if step_id is None or msg.step_id == step_id:
                    return msg
                self.num_stale += 1
                continue
            if isinstance(msg, ErrorReport):
                if msg.fatal:
                    self._fatal = msg.message
                    raise DraftServerError(f"draft server failed: {msg.message}")
                self._errors.append(msg)
                continue
            if msg is not None:
                raise DraftServerError(f"unexpected {type(msg).__name__} from the draft server")
            self._check_alive()
            if time.monotonic() >= deadline:
                return None

    def take_errors(self) -> list[ErrorReport]:
        """Non-fatal ErrorReports received so far (e.g. dropped rids to re-send); clears them."""
        errors, self._errors = self._errors, []
        return errors

    def _recv(self, timeout_s: float) -> object | None:
        try:
            return self._inbox.recv(timeout_s=timeout_s)
        except MessageError as exc:
            raise DraftServerError(f"malformed reply from the draft server: {exc}") from exc

    def _check_alive(self) -> None:
        if self._proc is None:
            raise DraftServerError("draft server not started")
        if self._fatal is not None:
            raise DraftServerError(f"draft server failed: {self._fatal}")
        if self._proc.poll() is not None:
            raise DraftServerError(
                f"draft server (pid {self._proc.pid}) exited with code {self._proc.returncode}"
                f" (log {self.log_path}):\n{_tail(self.log_path)}"
            )
