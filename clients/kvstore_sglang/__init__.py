"""kvstore as SGLang's HiCache L3 storage (``HiCacheStorage``).

Load it through SGLang's backend factory by module path::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvstore", "module_path": "kvstore_sglang.backend",
        "class_name": "KvstoreHiCacheStorage", "address": "127.0.0.1:7400"}'
"""
