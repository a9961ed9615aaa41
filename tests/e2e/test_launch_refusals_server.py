"""Bad launches the launcher's own check cannot see, because SGLang's parser alone reads the
flag (an abbreviation such as ``--tp`` for ``--tp-size``, or a ``--config`` file): refused once
SGLang parses its arguments, by our algorithm's ``handle_server_args``, still before any
scheduler or model starts. ``tests/unit/test_launch_refusals.py`` covers the rest, in-process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.preloaded import preloaded_launch, server_env

pytestmark = pytest.mark.server

TIMEOUT_S = 300  # SGLang's imports: ~20 s on an idle 2-core host, minutes on a loaded one


def launch(argv: list[str], tmp_path: Path) -> tuple[int, str]:
    """(exit status, stdout + stderr) of the launcher (forked from the session's preloaded one
    where it can be, ``tests/helpers/preloaded.py``); a launch that is not refused within
    ``TIMEOUT_S`` is killed with every process it started, and fails the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*argv, "--port", str(port)]
    env = server_env()
    launcher = preloaded_launch(env)
    if launcher is not None:
        log = tmp_path / "launch.log"
        proc = launcher.start(argv, log, env, cwd=tmp_path)
        try:
            proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"not refused within {TIMEOUT_S} s: {log.read_text()[-3000:]}")
        return proc.returncode, log.read_text(errors="replace")
    cmd = [sys.executable, "-m", "sgl_spec.launch_server", *argv]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        start_new_session=True, env=env,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"not refused within {TIMEOUT_S} s: {out[-3000:]}")
    return proc.returncode, out


# each serves --tp-size and --dp-size above 1, none --pp-size; --pp-s is SGLang's shortest
# unambiguous abbreviation of --pp-size (--pp alone also starts two other flags)
ABBREVIATED = ["MTP_LORA", "SPECBLOCK", "MINEDRAFT"]


@pytest.mark.parametrize("algorithm", sorted(ABBREVIATED))
def test_abbreviated_parallel_flag_is_refused(algorithm, tmp_path) -> None:
    returncode, out = launch(["--speculative-algorithm", algorithm, "--pp-s", "2"], tmp_path)
    assert returncode != 0
    assert f"{algorithm} supports --pp-size 1 only" in out, out[-3000:]
    assert "Load weight" not in out  # refused before a model loads


def test_parallel_setting_from_a_config_file_is_refused(tmp_path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("pp-size: 2\n")
    returncode, out = launch(
        ["--speculative-algorithm", "MTP_LORA", "--config", str(config)], tmp_path
    )
    assert returncode != 0
    assert "MTP_LORA supports --pp-size 1 only" in out, out[-3000:]
    assert "Load weight" not in out
