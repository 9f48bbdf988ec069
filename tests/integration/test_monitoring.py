"""The dashboard and the alert rules, proven: ``promtool`` checks the rules and runs their unit tests
(every alert fires on its case and stays quiet on the other), and a real Prometheus scrapes a live
3-node cluster under a short load that exercises every panel: each panel's queries, asked through
Prometheus' HTTP API, return a series with a non-zero value, and every metric the dashboard and the
rules name is one a node exports.

Prometheus and promtool come from Debian's ``prometheus`` package. Without them these tests skip,
unless ``KVSTORE_REQUIRE_PROMETHEUS=1`` (CI installs the package and sets it): then they fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore_client import KvClient
from tests.conftest import REPO_ROOT, keys_for, random_pages, wait_until
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.integration.test_cluster import MiB

MONITORING = REPO_ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "kvstore-dashboard.json"
TOKEN = "ops-token-0123456789"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("KVSTORE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{name} is not installed (KVSTORE_REQUIRE_PROMETHEUS=1)")
        pytest.skip(f"{name} is not installed (Debian: apt-get install --no-install-recommends prometheus)")
    return path


def test_the_rules_check_and_every_alert_passes_its_cases() -> None:
    promtool = _tool("promtool")
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        done = subprocess.run([promtool, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "alerts_test.yaml").read_text()))
    defined = set(re.findall(r"- alert: (\w+)", (MONITORING / "alerts.yaml").read_text()))
    assert tested == defined  # every alert has its firing and its quiet case


def _panel_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel["targets"]]


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(kvstore_[a-z_]+)", expr))


def _exported(text: str) -> set[str]:
    """Names a node's exposition offers, with each histogram's and counter's series names."""
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}


def _members(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        status = pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=5,
                                                     metadata=[("authorization", f"Bearer {TOKEN}")])
    return sorted(m.node_id for m in status.members)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    binary = _tool("prometheus")
    started: list[subprocess.Popen[bytes]] = []
    log = open(tmp_path / "prometheus.log", "wb")

    def start(targets: list[str]) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n"
                          f"  - {MONITORING / 'alerts.yaml'}\nscrape_configs:\n  - job_name: kvstored\n"
                          f"    static_configs:\n      - targets: {json.dumps(targets)}\n")
        port = _free_port()
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                stderr=log)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200
            except OSError:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                return False
        wait_until(ready, 30, "prometheus to be ready", lambda: (tmp_path / "prometheus.log").read_text()[-2000:])
        return url

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    log.close()


def _query(url: str, expr: str) -> list[float]:
    reply = urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10)
    data = json.loads(reply.read())
    assert data["status"] == "success", data
    return [float(series["value"][1]) for series in data["data"]["result"]]


def _plot(url: str, start: float, end: float, out: Path) -> None:
    """Every panel's queries over ``start``..``end``, asked of Prometheus, as one PNG (the dashboard without
    Grafana): ``KVSTORE_DASHBOARD_PNG=docs/img/dashboard.png pytest tests/integration/test_monitoring.py``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    cols = 3
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(15, 3.2 * ((len(panels) + 2) // cols)))
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 1})
            data = json.loads(urllib.request.urlopen(f"{url}/api/v1/query_range?{query}", timeout=10).read())
            for series in data["data"]["result"]:
                t = [float(v[0]) - start for v in series["values"]]
                y = [float(v[1]) for v in series["values"]]
                label = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: series["metric"].get(m.group(1), ""),
                               target["legendFormat"])
                ax.plot(t, y, label=label)
        ax.set_title(f"{panel['title']} ({panel['fieldConfig']['defaults']['unit']})", fontsize=9)
        ax.set_xlabel("s", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.suptitle("kvstore dashboard: a 3-node cluster under the test's load (Prometheus queries)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def test_every_panel_shows_data_from_a_live_cluster(daemon, prometheus, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "tokens.toml").write_text(f'[[token]]\ntoken = "{TOKEN}"\ntenant = "ops"\nrole = "admin"\n')
    common = ["--transport", "tcp", "--capacity", "32MiB",
              "--metrics-port", "0", "--token-file", str(tmp_path / "tokens.toml"),
              "--heartbeat-interval", "0.1", "--heartbeat-timeout", "2", "--replication", "predictive",
              "--planner-tick", "0.1", "--spec-ttl", "30", "--node-rate", "0.01", "--predictor-model", "none"]
    nodes: dict[str, Any] = {}
    for node_id in "abc":
        extra = ["--peers", nodes["a"].address] if nodes else []
        if node_id == "a":  # a disk tier under a's pool: what it evicts goes down, older reads come up
            extra = ["--tier", f"disk:{tmp_path / 'tier'}:{256 * MiB}"]
        nodes[node_id] = daemon("--node-id", node_id, *common, *extra)
    url = prometheus([f"127.0.0.1:{n.fields['metrics_port']}" for n in nodes.values()])
    began = time.time()
    clients = {n: KvClient(d.address, token=TOKEN) for n, d in nodes.items()}
    try:
        for n in "abc":
            wait_until(lambda n=n: _members(nodes[n].address) == ["a", "b", "c"], 10, "membership")
        a, b, c = clients["a"], clients["b"], clients["c"]
        for client in (a, b, c):  # the tenant's namespace (16 slots), on each node
            client.create_namespace("m", MiB, capacity=16 * MiB)
        empty: dict[str, str] = {}

        def every_panel_has_data() -> bool:
            empty.clear()
            for title, expr in _panel_queries():
                values = _query(url, expr.replace("$__rate_interval", "1m"))
                if not any(np.isfinite(v) and v != 0 for v in values):
                    empty[title] = f"{expr} -> {values}"
            return not empty

        # Prometheus has every node's namespace series before the load, so that it sees them grow
        wait_until(lambda: len(_query(url, 'kvstore_speculative_pages_total{outcome="hit"}')) == 3, 15,
                   "prometheus to scrape the namespaces")
        # a burst on a prefix of a's: the coordinator copies it to b and c ahead, and b reads its copy
        burst = keys_for(8, b"burst")
        a.put("m", burst, random_pages(8, MiB))
        wait_until(lambda: c.lookup_nodes("m", burst).nodes, 5, "the directory to show a's pages")
        for i in range(12):
            (b if i % 2 else c).lookup_nodes("m", burst, record=True)
        wait_until(lambda: b.lookup_nodes("m", burst).prefix_length > 0, 15, "a speculative copy on b")
        assert b.get("m", burst).found.all()  # reads the speculative copy (hits) and pulls the rest
        # then rounds of load a second apart, so that every counter grows between scrapes
        for round_ in range(20):
            other = keys_for(8, b"other%d-" % round_)
            a.put("m", other, random_pages(8, MiB, seed=100 + round_))
            wait_until(lambda: c.lookup_nodes("m", other).nodes, 5, "the directory to show a's pages")
            assert c.get("m", other).found.all()  # pulls a's pages: remote hits, peer bytes, remote fetch time
            assert a.get("m", other).found.all()  # local hits
            if round_ >= 2:  # evicted from a's pool since: promoted from its disk tier
                assert a.get("m", keys_for(8, b"other%d-" % (round_ - 2))).found.all()
            c.lookup_nodes("m", keys_for(4, b"coming%d-" % round_), claim_seconds=30)  # an in-flight claim
            b.put("m", keys_for(8, b"fill%d-" % round_), random_pages(8, MiB, seed=200 + round_))  # evictions
            with KvClient(nodes["a"].address, token="not-a-token") as stranger:
                with pytest.raises(Exception):
                    stranger.stats()
            if round_ >= 2 and every_panel_has_data():
                break
            time.sleep(1.0)
        assert every_panel_has_data(), empty
        if os.environ.get("KVSTORE_DASHBOARD_PNG"):
            time.sleep(5)
            _plot(url, began, time.time(), Path(os.environ["KVSTORE_DASHBOARD_PNG"]))
    finally:
        for client in clients.values():
            client.close()
    exported = _exported(urllib.request.urlopen(f"http://127.0.0.1:{nodes['a'].fields['metrics_port']}/metrics",
                                                timeout=5).read().decode())
    used = set().union(*(_metric_names(expr) for _, expr in _panel_queries()),
                       _metric_names((MONITORING / "alerts.yaml").read_text()))
    assert used <= exported, used - exported
