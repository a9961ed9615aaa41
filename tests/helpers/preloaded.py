"""A preloaded launcher for end-to-end tests: servers forked from one process that has already
imported SGLang, instead of a fresh interpreter per server.

A test server's start is mostly imports: the launcher imports SGLang (~12 s on a 2-core host),
then SGLang *spawns* its scheduler and detokenizer, which import it again (~11 s), before the
model loads (~2 s). This module runs one process per test session that imports the launcher,
SGLang's HTTP server, scheduler and detokenizer once, then, for each server, forks a child that
runs ``sgl_spec.launch_server.main`` with SGLang's multiprocessing start method set to *fork*:
the child and the scheduler and detokenizer it starts inherit the imports (a server is ready in
~5 s). Each child is a session leader (``killpg`` stops it and everything it started), logs to
the server's log, and sees the environment the test gave it.

What a fork cannot reproduce is a fresh interpreter: a spawned scheduler imports SGLang before
it loads plugins; a forked one inherits the launcher's modules after it loaded them. So tests of
the spawn path itself (``tests/e2e/test_default_server.py``: every algorithm from a bare
launcher) and any server whose environment differs from the preloaded process's
(``PYTHONPATH`` hooks, core bindings) start as users start them; ``SGLSPEC_TEST_PRELOADED=0``
starts every test server that way.

The same process runs the clients tests start beside a server (``CLIENT_MODULES``:
``sglang.bench_serving``, ~10 s of imports a run) as forked ``python -m MODULE`` children.

``python -m tests.helpers.preloaded SOCKET`` is the preloaded process; ``PreloadedLauncher``
is its client in the test process.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ENV_SWITCH = "SGLSPEC_TEST_PRELOADED"
# Set by pytest per test, read by nothing a server runs.
IGNORED_ENV = frozenset({"PYTEST_CURRENT_TEST"})
# Read by SGLang's scheduler when it starts, never at import: a forked server that sets it sees
# what a fresh one would.
RUNTIME_ENV = frozenset({"SGLANG_CPU_OMP_THREADS_BIND"})
READY_TIMEOUT_S = 180.0


# Modules a test runs as ``python -m MODULE`` besides the launcher (``PreloadedLauncher.run``).
CLIENT_MODULES = ("sglang.bench_serving",)


def _preload() -> None:
    """What the launcher and SGLang's spawned scheduler and detokenizer import before plugins,
    and the clients of ``CLIENT_MODULES``."""
    import sglang.bench_serving
    import sglang.launch_server
    import sglang.srt.managers.detokenizer_manager
    import sglang.srt.managers.scheduler  # noqa: F401

    import sgl_spec.launch_server  # noqa: F401


def fresh_interpreter_signals() -> None:
    """The signal dispositions a fresh interpreter starts with. Python ignores SIGPIPE and
    SIGXFSZ: a write to a socket whose peer has closed raises instead of killing the process, so
    a server whose client hangs up mid-response (the router's gRPC probe of an HTTP port) lives
    on, as one started by ``python -m`` does."""
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)


def _run_child(request: dict) -> int:
    """In the forked child: become the server's session leader, log to its log, run the
    launcher with SGLang's processes forked from this one (or ``request["module"]`` as
    ``__main__``); return the exit code."""
    os.setsid()
    fresh_interpreter_signals()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def fork_instead(method: str | None, force: bool = False) -> None:
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = fork_instead  # SGLang asks for "spawn"
    multiprocessing.set_start_method("fork")
    module = request.get("module")
    sys.argv = [module or "sgl_spec.launch_server", *request["argv"]]
    try:
        if module is None:
            from sgl_spec.launch_server import main

            main(request["argv"])
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


def _reap(codes: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        codes[pid] = os.waitstatus_to_exitcode(status)


def _answer(listener: socket.socket, conn: socket.socket, codes: dict[int, int]) -> None:
    with conn:
        request = json.loads(conn.makefile().readline())
        _reap(codes)
        if request["op"] == "poll":
            reply = {"returncode": codes.get(request["pid"])}
        else:  # start
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                code = _run_child(request)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            reply = {"pid": pid}
        conn.sendall((json.dumps(reply) + "\n").encode())


def serve(path: str) -> None:
    """The preloaded process: import, then fork a server per request until the test process
    (its parent) is gone."""
    _preload()
    if threading.active_count() != 1:  # a fork copies no thread but the caller's
        sys.exit(f"preloaded: threads after imports: {threading.enumerate()}")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(1.0)
    codes: dict[int, int] = {}
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            _reap(codes)
            continue
        conn.settimeout(None)
        _answer(listener, conn, codes)


def same_launch(env: dict[str, str], preloaded: dict[str, str], defaults: dict[str, str]) -> bool:
    """Whether a server with ``env`` sees what it would see started on its own when forked from
    a process started with ``preloaded``: the same environment, save variables only pytest
    reads and those SGLang reads at run time (``RUNTIME_ENV``), where a variable in ``defaults`` missing from ``env`` counts as its default (the
    launcher sets it so)."""
    keys = (set(env) | set(preloaded)) - IGNORED_ENV - RUNTIME_ENV
    return all(env.get(k, defaults.get(k)) == preloaded.get(k) for k in keys)


class ForkedServer:
    """The part of ``subprocess.Popen`` a ``ServerProcess`` uses, for a preloaded child."""

    def __init__(self, launcher: PreloadedLauncher, pid: int) -> None:
        self.launcher, self.pid = launcher, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.ask({"op": "poll", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"preloaded server {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test server runs with."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


class PreloadedLauncher:
    """Client of the session's preloaded process, started on first use."""

    _instance: PreloadedLauncher | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        from sgl_spec.launch_server import CPU_MALLOC_ENV

        self.dir = tempfile.mkdtemp(prefix="sglspec-preloaded-")
        self.path = os.path.join(self.dir, "sock")
        # Set before SGLang is imported: it reads the CPU-engine switch at import time, glibc
        # its malloc settings at process start. The launcher sets both for its processes unless
        # the environment already has them, so a server environment without them (or with the
        # same values) is the same launch.
        self.defaults = {"SGLANG_USE_CPU_ENGINE": "1", **CPU_MALLOC_ENV}
        self.env = {**self.defaults, **server_env()}
        self.log = Path(self.dir) / "preloaded.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.preloaded", self.path],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=Path(__file__).resolve().parents[2],
            )
        atexit.register(self.close)
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"preloaded launcher failed:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    @classmethod
    def get(cls) -> PreloadedLauncher:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def accepts(self, env: dict[str, str]) -> bool:
        return same_launch(env, self.env, self.defaults)

    def ask(self, request: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            conn.sendall((json.dumps(request) + "\n").encode())
            return json.loads(conn.makefile().readline())

    def start(
        self,
        argv: list[str],
        log_path: Path,
        env: dict[str, str],
        cwd: Path | None = None,
        module: str | None = None,
    ) -> ForkedServer:
        """Fork ``python -m sgl_spec.launch_server ARGV`` (or ``python -m MODULE ARGV``),
        appending to ``log_path``."""
        request = {"argv": argv, "log": str(log_path), "env": env, "cwd": str(cwd or Path.cwd())}
        reply = self.ask({"op": "start", "module": module, **request})
        return ForkedServer(self, reply["pid"])

    def run(self, module: str, argv: list[str], log_path: Path) -> ForkedServer:
        """Fork ``python -m MODULE ARGV`` (one of ``CLIENT_MODULES``, writing to ``log_path``)
        in the test's environment and working directory."""
        if module not in CLIENT_MODULES:
            raise ValueError(f"{module} is not preloaded: one of {CLIENT_MODULES}")
        return self.start(argv, log_path, server_env(), module=module)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def preloaded_launch(env: dict[str, str]) -> PreloadedLauncher | None:
    """The session's preloaded launcher, if it can start a launch with ``env``."""
    if not enabled():
        return None
    launcher = PreloadedLauncher.get()
    return launcher if launcher.accepts(env) else None


def enabled() -> bool:
    """Preloaded starts are on unless ``SGLSPEC_TEST_PRELOADED=0``, and only on a CPU host
    (the preloaded process sets SGLang's CPU-engine switch)."""
    if os.environ.get(ENV_SWITCH, "1").lower() in ("0", "false", "off"):
        return False
    import torch

    return not torch.cuda.is_available()


if __name__ == "__main__":
    serve(sys.argv[1])
