"""The coordinator's answer to the predictor's ``holders`` feature: the nodes that hold a page other than as a
speculative replica no request has read yet."""

from __future__ import annotations

from kvstore.cluster.coordinator import Coordinator
from kvstore.cluster.directory import Directory, Outbox
from kvstore.cluster.membership import Membership
from kvstore.cluster.peers import PeerClient
from kvstore.config import NodeConfig
from kvstore.metrics import NodeMetrics
from kvstore.pool.pool import PageKind
from kvstore.v1 import kvstore_pb2 as pb
from tests.unit.cluster.test_cluster_logic import NoNamespaces, Page, info


def test_unread_speculative_replicas_are_no_holders_for_the_predictor() -> None:
    members = Membership(info("a"), 2.0)
    directory = Directory()
    coordinator = Coordinator(NodeConfig(listen="127.0.0.1:0", replication="full"), directory, members,
                              PeerClient(members), NodeMetrics(NoNamespaces()), page_bytes=lambda ns: 4096)
    count = coordinator.core._holders_count
    directory.report("a", "i", 1, True, [pb.DirectoryBatch(namespace="m", adds=[b"k1", b"k2"])])
    outboxes = {}
    for node in ("b", "c", "d"):  # the coordinator's copies of the prefix, landed and unread
        outboxes[node] = out = Outbox()
        out.record("m", [Page(b"k1", PageKind.SPECULATIVE, expires_at=60.0),
                         Page(b"k2", PageKind.SPECULATIVE, expires_at=60.0)])
        seq, batches = out.take(now=0.0)
        directory.report(node, "i", seq, True, batches, now=0.0)
    assert directory.holders("m", b"k2") == {"a", "b", "c", "d"}
    # the score that sized the copies does not fall because they landed
    assert count("m", b"k1") == 1 and count("m", b"k2") == 1
    out = outboxes["c"]
    out.record("m", [Page(b"k1", PageKind.REPLICA), Page(b"k2", PageKind.REPLICA)])  # a request on c read them
    seq, batches = out.take(now=1.0)
    directory.report("c", "i", seq, False, batches, now=1.0)
    assert count("m", b"k2") == 2 and count("m", b"nowhere") == 0
