"""Servers for end-to-end tests: the public launcher with settings that keep a 2-core host quick."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import requests
from server_process import ServerProcess, pick_port, tail

from tests.helpers.preloaded import ForkedServer, preloaded_launch, server_env

# Small KV pool and no warm-up keep start-up short on a 2-core host. --max-total-tokens caps
# the pool; the static fraction only has to leave room for what is loaded before SGLang profiles
# free RAM, which with MINEDRAFT includes the draft-server process (~4% of this 24 GiB host).
COMMON_ARGS = [
    "--dtype", "float32",
    "--mem-fraction-static", "0.25",
    "--max-total-tokens", "16384",
    "--skip-server-warmup",
    "--log-level", "warning",
]  # fmt: skip
# The launcher's own KV pool sizing (sgl_spec/cpu_memory.py) instead of the test's small pool.
DEFAULT_POOL_ARGS = ["--dtype", "float32", "--skip-server-warmup"]


class PreloadedServerProcess(ServerProcess):
    """A ``ServerProcess`` forked from the session's preloaded launcher
    (``tests/helpers/preloaded.py``) where its environment allows, unless ``preloaded`` is
    false: then started as a user starts it."""

    preloaded = True

    def _launch(self, env: dict[str, str]) -> subprocess.Popen | ForkedServer:
        launcher = preloaded_launch(env) if self.preloaded else None
        if launcher is None:
            return super()._launch(env)
        self._log.flush()
        return launcher.start(self.argv, self.log_path, env)


class Server(PreloadedServerProcess):
    """A ready server (``wait=False``: a started one) on a free port; ``stop()`` when done,
    preloaded unless ``preloaded=False`` (``PreloadedServerProcess``)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        timeout: float = 420.0,
        common: list[str] = COMMON_ARGS,
        env: dict[str, str] | None = None,
        preloaded: bool = True,
        wait: bool = True,
    ) -> None:
        self.preloaded = preloaded
        super().__init__([*common, *args], pick_port(), log_path, env)
        if not wait:  # e.g. a follower node, which serves no HTTP
            return
        try:
            self.wait_ready(timeout)
        except Exception:
            self.stop()
            raise

    def stop(self, graceful: bool = False) -> None:
        """Kill at once: a test keeps nothing of a server it is done with, and SGLang's drain on
        SIGTERM costs ~5 s a server."""
        super().stop(graceful)

    def tail(self, num_lines: int = 60) -> str:
        return tail(self.log_path, num_lines)

    def draft_servers(self) -> int:
        """MINEDRAFT draft-server processes under this server."""
        import psutil

        children = psutil.Process(self.proc.pid).children(recursive=True)
        return sum("sgl_spec.minedraft.draft_server" in " ".join(c.cmdline()) for c in children)

    def generate(self, payload: dict, timeout: float = 600.0) -> dict | list:
        resp = requests.post(self.url + "/generate", json=payload, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def check_bad_request_keeps_serving(self) -> None:
        """An invalid request gets SGLang's 4xx; the next valid one is served."""
        bad = requests.post(
            self.url + "/generate",
            json={"text": "x", "sampling_params": {"temperature": -1.0, "max_new_tokens": 4}},
            timeout=60,
        )
        assert 400 <= bad.status_code < 500, bad.text
        ok = self.generate(
            {"text": "x", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
        )
        assert len(ok["output_ids"]) == 4


class ServerPool:
    """Starts servers by name, keeping at most one alive: an idle SGLang scheduler busy-polls a
    core, so servers left running slow every later test on a 2-core host. Tests are grouped by
    server so each starts once."""

    def __init__(self, args: dict[str, list[str]], logs: Path) -> None:
        self.args, self.logs = args, logs
        self.name: str | None = None
        self.server: Server | None = None

    def __call__(self, name: str) -> Server:
        if name != self.name:
            self.close()
            self.server = Server(self.args[name], self.logs / f"{name}.log")
            self.name = name
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server, self.name = None, None


def start_bench_serving(
    server: Server, tokenizer: Path, out_file: Path, num_prompts: int, concurrency: int, length: int
) -> subprocess.Popen | ForkedServer:
    """``python -m sglang.bench_serving`` against ``server``, unchanged, as the benchmark runs it
    (``benchmarks/_bench_lib.py``: offline ``random-ids``, fixed seed, so the same prompts on
    every server; greedy), ``length`` input and output tokens, per-request details in
    ``out_file``."""
    from _bench_lib import bench_serving_argv

    load = SimpleNamespace(
        input_len=length, output_len=length, num_prompts=num_prompts, max_concurrency=concurrency
    )
    argv = [*bench_serving_argv(server.port, load, str(tokenizer), out_file), "--output-details"]
    log_path = out_file.with_suffix(".log")
    launcher = preloaded_launch(server_env())
    if launcher is not None:  # its client imports (~10 s) done once per session
        module = argv.index("-m") + 1
        log_path.write_text("")
        return launcher.run(argv[module], argv[module + 1 :], log_path)
    with open(log_path, "w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def finish_bench_serving(
    proc: subprocess.Popen | ForkedServer, out_file: Path, timeout: float = 900
) -> dict:
    """Wait for a ``start_bench_serving`` run; its result with per-request details."""
    code = proc.wait(timeout)
    log = out_file.with_suffix(".log").read_text(errors="replace")
    assert code == 0, log[-4000:]
    return json.loads(out_file.read_text().strip().splitlines()[-1])
