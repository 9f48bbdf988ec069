"""Many nodes as one store.

``membership`` (who is alive, who coordinates: the gossip and etcd backends,
their views) and ``directory`` (which node holds which page) are pure logic,
tested without sockets; ``agent`` runs
them: heartbeats, directory reports, remote fetch and replication over a
``kvstore.transport`` backend; ``service`` is the node-to-node gRPC API.
"""
