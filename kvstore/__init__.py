"""kvstore: a distributed KV-cache store daemon for LLM inference.

Parts (see docs/architecture.md): ``pool`` (page slots), ``ops`` (pack/unpack
and engine gather/scatter kernels, CuPy or numpy), ``node`` (namespaces,
leases, batches), ``server`` (gRPC API + health), ``datapath`` (bulk bytes
over a framed TCP channel), ``cli`` (``kvstored``, ``kvctl``).
"""

__version__ = "0.1.0"
