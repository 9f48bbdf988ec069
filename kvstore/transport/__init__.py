"""Node-to-node page transfer behind one small interface.

``base.Transport`` is the interface; ``tcp.TcpTransport`` (plain asyncio
sockets, framed like the data channel) and ``ucx.UcxTransport`` (ucxx) are
the backends; ``auto.make_transport`` picks one by name, ``auto`` preferring
UCX when ``ucxx`` imports.
"""
