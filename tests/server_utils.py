"""Servers for end-to-end tests: the public launcher with settings that keep a 2-core host quick."""

from __future__ import annotations

from pathlib import Path

import requests

from sgl_spec.server_process import ServerProcess, pick_port, tail

# Small KV pool and no warm-up keep start-up short on a 2-core host.
COMMON_ARGS = [
    "--dtype", "float32",
    "--mem-fraction-static", "0.05",
    "--max-total-tokens", "16384",
    "--skip-server-warmup",
    "--log-level", "warning",
]  # fmt: skip


class Server(ServerProcess):
    """A ready server on a free port; ``stop()`` when done."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 420.0) -> None:
        super().__init__([*COMMON_ARGS, *args], pick_port(), log_path)
        try:
            self.wait_ready(timeout)
        except Exception:
            self.stop()
            raise

    def tail(self, num_lines: int = 60) -> str:
        return tail(self.log_path, num_lines)

    def generate(self, payload: dict, timeout: float = 600.0) -> dict | list:
        resp = requests.post(self.url + "/generate", json=payload, timeout=timeout)
        resp.raise_for_status()
        return resp.json()
