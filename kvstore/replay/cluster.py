"""A local cluster of real ``kvstored`` processes on 127.0.0.1 for one policy run.

Nodes ``n0 .. n{N-1}`` start on port 0; ``n0`` (the lowest id, so the
coordinator) starts first and is every other node's ``--peers`` seed. Each
process writes stdout and stderr to its own log file (no pipe can fill up
and block it); the harness reads its ``kvstored ready grpc=...`` line from
there. :meth:`LocalCluster.stop` sends SIGTERM, waits, then SIGKILLs: it
runs from ``with`` exits and ``finally`` blocks, so no process is left
behind on errors, Ctrl-C or SIGTERM (the CLI turns SIGTERM into
KeyboardInterrupt). On Linux each daemon also gets ``PR_SET_PDEATHSIG``
(SIGTERM), so even a SIGKILLed harness leaves no node running.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvstore.config import setting_flags
from kvstore.replay.netns import NetnsLinks
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM this process when the harness dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


@dataclass(slots=True)
class ClusterSpec:
    nodes: int = 4
    policy: str = "reactive"           # the daemons' --replication
    namespace: str = "llama3-8b"
    page_bytes: int = 16384
    capacity: str = "256MiB"
    settings: dict[str, Any] = field(default_factory=dict)  # more kvstored settings, by name
    extra: list[str] = field(default_factory=list)   # kvstored flags as given (--kvstored-arg), last
    network: str = "none"              # none | shaped (--link-rate in the daemons) | netns (tc on veths)
    link_rate: float = 0.0             # real bytes/s per node and direction (already scaled)
    link_latency: float = 0.0          # real seconds, one way
    disk_tier: int = 0                 # bytes of a disk tier below each pool (already scaled; 0: none)
    disk_read_rate: float = 0.0        # its reads and writes, real bytes/s (already scaled; 0: unpaced)
    disk_write_rate: float = 0.0
    disk_admit: str = "all"            # the disk tier's --tier-admit
    disk_write_budget: float = 0.0     # ... predicted: its --tier-write-budget (real bytes/s) and
    disk_reuse_horizon: float = 600.0  # --tier-reuse-horizon (real s)
    tier_root: str = ""                # where the nodes' disk tiers live (LocalCluster: under its log folder)

    def args(self, node_id: str, host: str = "127.0.0.1") -> list[str]:
        shaped = ["--link-rate", repr(self.link_rate), "--link-latency", repr(self.link_latency)] \
            if self.network == "shaped" else []
        if self.disk_tier:
            root = self.tier_root or "/nonexistent/kvstore-replay-tiers"  # the simulator only parses it
            shaped += ["--tier", f"disk:{root}/{node_id}:{self.disk_tier}",
                       "--tier-read-rate", repr(self.disk_read_rate), "--tier-write-rate", repr(self.disk_write_rate),
                       "--tier-admit", self.disk_admit, "--tier-write-budget", repr(self.disk_write_budget),
                       "--tier-reuse-horizon", repr(self.disk_reuse_horizon)]
        # a netns node listens on its veth address inside namespaces this benchmark made and removes,
        # reachable from nothing else: development mode without the loopback check
        private = ["--insecure", "true"] if host != "127.0.0.1" else []
        return ["--node-id", node_id, "--listen", f"{host}:0", *private,
                "--capacity", self.capacity, "--namespace", f"{self.namespace}:{self.page_bytes}",
                "--replication", self.policy, *setting_flags(self.settings),
                "--metrics-port", "0", "--log-level", "warning", *shaped, *self.extra]


@dataclass(slots=True)
class NodeProc:
    node_id: str
    proc: subprocess.Popen  # type: ignore[type-arg]
    log: Path
    address: str = ""
    metrics_port: int = 0


class LocalCluster:
    """``with LocalCluster(spec, log_dir) as c: c.nodes[i].address``."""

    def __init__(self, spec: ClusterSpec, log_dir: Path, start_timeout: float = 60.0) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.start_timeout = start_timeout
        self.nodes: list[NodeProc] = []
        self.links: NetnsLinks | None = None

    def network(self) -> dict[str, object]:
        """How node-to-node bytes are shaped in this cluster (for results.json)."""
        if self.links is not None:
            return self.links.describe()
        if self.spec.network == "shaped":
            return {"kind": "shaped", "rate_bytes_s": self.spec.link_rate, "latency_s": self.spec.link_latency,
                    "shaping": "token buckets in each kvstored's peer transport (egress + ingress)"}
        return {"kind": "none"}

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- start -------------------------------------------------------------
    def _spawn(self, node_id: str, seed: str | None) -> NodeProc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{node_id}.log"
        i = len(self.nodes)
        host = self.links.address(i) if self.links is not None else "127.0.0.1"
        prefix = self.links.exec_prefix(i) if self.links is not None else []
        args = [*prefix, sys.executable, "-m", "kvstore.cli.kvstored", *self.spec.args(node_id, host)]
        if seed:
            args += ["--peers", seed]
        env = dict(os.environ, PYTHONUNBUFFERED="1", GRPC_ENABLE_FORK_SUPPORT="0")
        with open(log, "w") as f:
            proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True,  # Ctrl-C in the terminal goes to the harness only
                                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        node = NodeProc(node_id, proc, log)
        self.nodes.append(node)
        return node

    def _wait_ready(self, node: NodeProc, deadline: float) -> None:
        pattern = re.compile(r"kvstored ready grpc=(\S+) data_port=\S+ metrics_port=(\d+)")
        while True:
            text = node.log.read_text(errors="replace") if node.log.exists() else ""
            m = pattern.search(text)
            if m:
                node.address, node.metrics_port = m.group(1), int(m.group(2))
                return
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvstored {node.node_id} did not start (exit {node.proc.poll()}): "
                                   f"{text[-2000:]}")
            time.sleep(0.05)

    def start(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        if self.spec.disk_tier:  # a fresh disk for every run: a disk tier keeps its pages over a restart
            self.spec.tier_root = str((self.log_dir / "tiers").resolve())
            shutil.rmtree(self.spec.tier_root, ignore_errors=True)
        if self.spec.network == "netns":
            self.links = NetnsLinks(self.spec.nodes, self.spec.link_rate, self.spec.link_latency).__enter__()
        first = self._spawn("n0", None)
        self._wait_ready(first, deadline)
        rest = [self._spawn(f"n{i}", first.address) for i in range(1, self.spec.nodes)]
        for node in rest:
            self._wait_ready(node, deadline)
        # every node sees every other alive and n0 as coordinator
        for node in self.nodes:
            while True:
                st = self.status(node.address)
                if st is not None and len(st.members) == self.spec.nodes and st.coordinator == "n0":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster membership did not converge on {node.node_id}")
                time.sleep(0.05)

    # ---- queries -----------------------------------------------------------
    @staticmethod
    def status(address: str) -> pb.ClusterStatusResponse | None:
        try:
            with grpc.insecure_channel(address) as channel:
                return pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=2)
        except grpc.RpcError:
            return None

    def scrape(self, index: int = 0) -> str:
        """The Prometheus text of node ``index`` ('' if it cannot be read)."""
        port = self.nodes[index].metrics_port
        try:
            host = self.links.address(index) if self.links is not None else "127.0.0.1"
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (failover runs); :meth:`stop` reaps it."""
        proc = self.nodes[index].proc
        if proc.poll() is None:
            proc.kill()

    def cpu_seconds(self) -> list[float]:
        """CPU seconds (user + system) each node's process has used so far, from ``/proc`` (0.0 where it
        cannot be read: not Linux, or the node is gone). ``ip netns exec`` execs, so the pid is the daemon."""
        out = []
        for node in self.nodes:
            try:
                fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out.append((int(fields[11]) + int(fields[12])) / _CLK_TCK)  # utime, stime (fields 14, 15)
            except (OSError, IndexError, ValueError):
                out.append(0.0)
        return out

    # ---- stop --------------------------------------------------------------
    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every node, wait up to ``grace`` seconds, then SIGKILL what is left."""
        for node in self.nodes:
            if node.proc.poll() is None:
                try:
                    node.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for node in self.nodes:
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(10)
        self.nodes = []
        if self.spec.tier_root:  # the modelled NVMe's slab files: hundreds of MB a run
            shutil.rmtree(self.spec.tier_root, ignore_errors=True)
        if self.links is not None:  # after the daemons: no process holds a namespace any more
            self.links.close()
            self.links = None

