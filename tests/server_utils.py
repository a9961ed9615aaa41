"""Start/stop ``python -m sgl_spec.launch_server`` for end-to-end tests (the public command)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
# Small KV pool and no warm-up keep start-up short on a 2-core host.
COMMON_ARGS = [
    "--dtype",
    "float32",
    "--mem-fraction-static",
    "0.05",
    "--max-total-tokens",
    "16384",
    "--skip-server-warmup",
    "--log-level",
    "warning",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process; ``url`` once ready. Logs go to ``log_path`` for post-mortems."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 420.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "sgl_spec.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *COMMON_ARGS,
            *args,
        ]
        self._log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def generate(self, payload: dict, timeout: float = 600.0) -> dict | list:
        resp = requests.post(self.url + "/generate", json=payload, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._log.close()
