"""kvstored under a service manager: the test plays systemd's side of the notify socket with a real
node (READY once it serves, watchdog pings, STOPPING on SIGTERM), and the shipped unit passes
``systemd-analyze verify``."""

from __future__ import annotations

import getpass
import grp
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore_client import KvClient
from tests.conftest import REPO_ROOT

UNIT = REPO_ROOT / "deploy" / "systemd" / "kvstored.service"


def _messages(sock: socket.socket, seconds: float, enough: Callable[[list[str]], bool]) -> list[str]:
    """Datagrams as they come, until ``enough(received)`` or ``seconds`` passed."""
    out: list[str] = []
    until = time.monotonic() + seconds
    while not enough(out) and time.monotonic() < until:
        sock.settimeout(max(0.01, until - time.monotonic()))
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            break
    return out


@pytest.mark.parametrize("abstract", [False, True])
def test_the_node_tells_its_supervisor_ready_alive_and_stopping(daemon, tmp_path: Path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                abstract: bool) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"@kvstore-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else str(tmp_path / "notify")
    sock.bind("\0" + name[1:] if abstract else name)
    with sock:
        monkeypatch.setenv("NOTIFY_SOCKET", name)
        monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping every 0.1 s
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        node = daemon()  # returns once the node printed its ready line
        first = _messages(sock, 5.0, lambda got: len(got) >= 1)
        assert first and "READY=1" in first[0].splitlines(), first
        assert f"MAINPID={node.proc.pid}" in first[0].splitlines() and "STATUS=serving" in first[0]
        with KvClient(node.address) as kv:  # ready means it answers
            kv.create_namespace("m", 4096)
        pings = _messages(sock, 10.0, lambda got: got.count("WATCHDOG=1") >= 4)
        assert pings.count("WATCHDOG=1") >= 4, pings  # one every 0.1 s while the event loop turns
        node.proc.send_signal(15)
        rest = _messages(sock, 10.0, lambda got: any("STOPPING=1" in m.splitlines() for m in got))
        assert any("STOPPING=1" in m.splitlines() for m in rest), rest
        assert node.proc.wait(30) == 0


def test_without_a_notify_socket_nothing_is_sent() -> None:
    from kvstore.server.supervisor import Supervisor

    quiet = Supervisor(environ={"WATCHDOG_USEC": "100000"})
    assert not quiet.active and not quiet.notify(READY=1)
    wrong_pid = Supervisor(environ={"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "100000",
                                    "WATCHDOG_PID": str(os.getpid() + 1)})
    assert wrong_pid.watchdog_s == 0  # the watchdog is meant for another process
    assert not wrong_pid.notify(READY=1)  # nobody listens: reported, not raised


def _verify(unit_text: str, where: Path) -> subprocess.CompletedProcess[str]:
    path = where / "kvstored.service"
    path.write_text(unit_text)
    return subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60,
                          cwd=where)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_shipped_unit_verifies(tmp_path: Path) -> None:
    """The unit as shipped, with ExecStart and User pointing at what exists here (verify checks both)."""
    kvstored = Path(sys.executable).with_name("kvstored")
    assert kvstored.exists()
    user, group = getpass.getuser(), grp.getgrgid(os.getgid()).gr_name
    text = (UNIT.read_text().replace("/usr/local/bin/kvstored", str(kvstored))
            .replace("User=kvstore", f"User={user}").replace("Group=kvstore", f"Group={group}"))
    assert text != UNIT.read_text()
    done = _verify(text, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = _verify(text.replace(str(kvstored), str(tmp_path / "no-such-binary")), tmp_path)
    assert broken.returncode != 0  # the check can fail
