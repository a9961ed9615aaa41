"""The preloaded test launcher forks a server only when the server's environment is the one
the preloaded process imported SGLang with (``tests/helpers/preloaded.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.preloaded import (
    CLIENT_MODULES,
    PreloadedLauncher,
    fresh_interpreter_signals,
    same_launch,
)

DEFAULTS = {"SGLANG_USE_CPU_ENGINE": "1", "MALLOC_MMAP_THRESHOLD_": "33554432"}
PRELOADED = {**DEFAULTS, "PATH": "/bin", "PYTHONUNBUFFERED": "1"}


def test_same_environment_is_the_same_launch() -> None:
    assert same_launch(dict(PRELOADED), PRELOADED, DEFAULTS)


def test_launcher_defaults_may_be_missing_but_not_different() -> None:
    assert same_launch({"PATH": "/bin", "PYTHONUNBUFFERED": "1"}, PRELOADED, DEFAULTS)
    assert not same_launch({**PRELOADED, "SGLANG_USE_CPU_ENGINE": "0"}, PRELOADED, DEFAULTS)


def test_pytest_bookkeeping_is_ignored() -> None:
    env = {**PRELOADED, "PYTEST_CURRENT_TEST": "tests/e2e/x.py::test (call)"}
    assert same_launch(env, PRELOADED, DEFAULTS)


def test_an_added_changed_or_removed_variable_is_a_different_launch() -> None:
    assert not same_launch({**PRELOADED, "PYTHONPATH": "/hooks"}, PRELOADED, DEFAULTS)
    assert not same_launch({**PRELOADED, "PATH": "/usr/bin"}, PRELOADED, DEFAULTS)
    removed = {k: v for k, v in PRELOADED.items() if k != "PATH"}
    assert not same_launch(removed, PRELOADED, DEFAULTS)


def test_core_bindings_read_at_run_time_may_differ() -> None:
    env = {**PRELOADED, "SGLANG_CPU_OMP_THREADS_BIND": "1"}
    assert same_launch(env, PRELOADED, DEFAULTS)


def test_only_preloaded_clients_are_run() -> None:
    """Any other module would be imported in the fork, after SGLang and the launcher (not as
    ``python -m`` would run it, and with no time saved): refused before anything is asked."""
    assert "sglang.bench_serving" in CLIENT_MODULES
    with pytest.raises(ValueError, match="not preloaded"):
        PreloadedLauncher.run(None, "sglang.launch_server", [], Path("x.log"))  # type: ignore[arg-type]


def test_a_forked_server_keeps_the_signal_dispositions_of_a_fresh_interpreter() -> None:
    """A fresh ``python`` ignores SIGPIPE: a forked server must too, or the first write to a
    socket its peer closed kills it silently (the router's gRPC probe did, now and then)."""
    code = (
        "import signal; print([int(signal.getsignal(s)) for s in (signal.SIGPIPE, signal.SIGXFSZ)])"
    )
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the preloaded process's dispositions, then the reset
        os.close(read)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        fresh_interpreter_signals()
        got = [int(signal.getsignal(s)) for s in (signal.SIGPIPE, signal.SIGXFSZ)]
        ok = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        os.write(write, f"{got}{ok}\n".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    assert answer == f"{fresh.stdout.strip()}True\n"
