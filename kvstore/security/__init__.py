"""Who may talk to a node and how the bytes are protected.

``tls``: TLS contexts and gRPC credentials for every port, reloaded when the
files change. ``tokens``: client tokens -> (tenant, role), tenant quotas.
``identity``: the cluster secret, HMAC proofs that a caller is a peer.
"""
