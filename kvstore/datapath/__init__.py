"""Bulk page bytes over a framed TCP channel, beside the gRPC control API.

gRPC serialises every page into a protobuf message and copies it at least
twice; this channel receives page bytes straight into pool slots
(``sock_recv_into``) and sends them straight out of slots. See
``wire.py`` for the frame format and ``server.py`` for the node side; the
client side lives in ``kvstore_client``.
"""
