"""Start a real ``kvstored`` process and wait until it serves.

Used by the demo, the benchmarks and the tests: the node binds port 0 (or
what the arguments say) and prints one ``kvstored ready grpc=... data_port=...
metrics_port=... node_id=...`` line, which is the readiness signal (no sleeps).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence


class NodeProcess:
    """A ``kvstored`` child process; ``fields`` holds its ready line's values."""

    def __init__(self, args: Sequence[str], *, device: str = "cpu", log_level: str = "warning",
                 capture_stderr: bool = False) -> None:
        argv = [sys.executable, "-m", "kvstore.cli.kvstored", "--listen", "127.0.0.1:0", "--device", device,
                "--log-level", log_level, *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # stderr (the node's log) goes to a file, never an unread pipe that
        # could fill up and stall the node
        self.log = tempfile.TemporaryFile(mode="w+") if capture_stderr else None
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, stderr=self.log)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("kvstored ready"):
            self.kill()
            raise RuntimeError(f"kvstored did not start: {line!r} {self.log_text()}")
        self.fields = dict(part.split("=", 1) for part in line.split()[2:])
        self.address = self.fields["grpc"]

    def log_text(self) -> str:
        """What the node wrote to stderr (when captured)."""
        if self.log is None or self.log.closed:
            return ""
        self.log.seek(0)
        return self.log.read()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.log is not None:
            self.log.close()

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, then SIGKILL if needed; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait(10)
        self._close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close()
