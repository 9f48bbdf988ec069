"""The membership backend ``--membership`` names: ``gossip`` (the default,
heartbeats between peers) or ``etcd://``/``etcds://`` (leases and an
elected coordinator on etcd; imported only then, as its client is an
optional dependency)."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.cluster.membership.gossip import Membership, MembershipView
from kvstore.config import NodeConfig
from kvstore.v1 import kvstore_pb2 as pb


def make_membership(config: NodeConfig, self_info: pb.MemberInfo,
                    on_change: Callable[[], None] = lambda: None) -> MembershipView:
    """This node's membership; ``on_change`` is called when an outside engine
    changes the view between heartbeat rounds, so the agent acts at once."""
    if config.membership == "gossip":
        return Membership(self_info, config.heartbeat_timeout)
    from kvstore.cluster.membership.etcd import EtcdMembership

    return EtcdMembership.from_config(config, self_info, on_change)
