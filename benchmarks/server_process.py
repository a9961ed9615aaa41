"""Run ``python -m sgl_spec.launch_server`` as a child process (benchmarks, end-to-end tests).

The server gets its own process group so ``stop()`` also ends SGLang's scheduler and
detokenizer children, and only those: never stop servers by name, other sessions run theirs.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

HOST = "127.0.0.1"


def pick_port(start: int = 0) -> int:
    """A free local port: the first at or above ``start``, or, when ``start`` is 0, a random one
    in ``[10000, 22000)``: under the kernel's ephemeral range, whose ports other processes get
    from ``bind(0)`` and ``connect()`` while the server is still loading and has not bound its
    own, and under SGLang's own pick for ports bound later (22000-29999)."""
    candidates = random.sample(range(10000, 22000), 64) if start == 0 else range(start, start + 200)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port among {len(candidates)} tried (start {start})")


def tail(path: Path, num_lines: int = 30, line_width: int = 300) -> str:
    """The end of a log, each line cut short (SGLang logs its whole ServerArgs on one line)."""
    try:
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return ""
    return "\n".join(line[:line_width] for line in lines)


class ServerProcess:
    def __init__(
        self, flags: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.argv = ["--host", HOST, "--port", str(port), *flags]  # the launcher's
        self.cmd = [sys.executable, "-m", "sgl_spec.launch_server", *self.argv]
        self._log = open(log_path, "w")
        self._log.write(shlex.join(self.cmd) + "\n")
        self._log.flush()
        self.proc = self._launch({**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def _launch(self, env: dict[str, str]) -> subprocess.Popen:
        """Start ``self.cmd`` in its own session, logging to ``self.log_path``."""
        return subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited during start-up with code {self.proc.returncode}"
                    f" (log {self.log_path}):\n{tail(self.log_path)}"
                )
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"server not ready in {timeout:.0f}s (log {self.log_path}):\n{tail(self.log_path)}"
        )

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM (SGLang drains and exits: ~5 s), SIGKILL if that takes 30 s; ``graceful=False``
        kills the whole group at once (nothing of the server is kept after it)."""
        for sig in (signal.SIGTERM, signal.SIGKILL) if graceful else (signal.SIGKILL,):
            if self.proc.poll() is not None:
                break
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # children that outlived the launcher (scheduler, detokenizer)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
