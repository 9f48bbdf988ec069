"""A small cluster of real ``kvstored`` processes for the engine-connector
tests: nodes a, b, ... on 127.0.0.1:0 with fast heartbeats, ready when every
node sees every other (no sleeps)."""

from __future__ import annotations


import grpc

from tests.conftest import wait_until
from kvstore.launch import NodeProcess
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

FAST = ("--heartbeat-interval", "0.1", "--heartbeat-timeout", "1.0")


def members(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=5)
    return sorted(m.node_id for m in reply.members)


def start_cluster(ids: str = "ab", capacity: str = "256MiB", *extra: str) -> dict[str, NodeProcess]:
    """Start one node per id (the first is the seed) and wait for membership."""
    nodes: dict[str, NodeProcess] = {}
    seed = None
    try:
        for node_id in ids:
            args = ["--node-id", node_id, "--capacity", capacity, "--transport", "tcp", *FAST, *extra]
            if seed is not None:
                args += ["--peers", seed]
            nodes[node_id] = NodeProcess(args, capture_stderr=True)
            seed = seed or nodes[node_id].address
        for node in nodes.values():
            wait_until(lambda node=node: members(node.address) == sorted(ids), 15, "membership to converge")
    except BaseException:
        for node in nodes.values():
            node.kill()
        raise
    return nodes
