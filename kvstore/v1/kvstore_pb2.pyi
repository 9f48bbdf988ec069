from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FP16: _ClassVar[DType]
    BF16: _ClassVar[DType]
    FP8_E4M3: _ClassVar[DType]
    FP8_E5M2: _ClassVar[DType]
    FP32: _ClassVar[DType]

class PageKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_KIND_UNSPECIFIED: _ClassVar[PageKind]
    PRIMARY: _ClassVar[PageKind]
    REPLICA: _ClassVar[PageKind]
    SPECULATIVE: _ClassVar[PageKind]
DTYPE_UNSPECIFIED: DType
FP16: DType
BF16: DType
FP8_E4M3: DType
FP8_E5M2: DType
FP32: DType
PAGE_KIND_UNSPECIFIED: PageKind
PRIMARY: PageKind
REPLICA: PageKind
SPECULATIVE: PageKind

class PageLayout(_message.Message):
    __slots__ = ("page_bytes", "block_tokens", "num_layers", "kv_heads", "head_dim", "dtype")
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    page_bytes: int
    block_tokens: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: DType
    def __init__(self, page_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class CreateNamespaceRequest(_message.Message):
    __slots__ = ("namespace", "layout", "capacity_bytes", "exist_ok")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: PageLayout
    capacity_bytes: int
    exist_ok: bool
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., capacity_bytes: _Optional[int] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace", "layout", "capacity_bytes", "num_slots", "used_slots", "pinned_slots", "device")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: PageLayout
    capacity_bytes: int
    num_slots: int
    used_slots: int
    pinned_slots: int
    device: str
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., capacity_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., pinned_slots: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class DescribeNamespaceRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class DeleteNamespaceRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class DeleteNamespaceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "keys", "pages", "kind")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pages: _containers.RepeatedScalarFieldContainer[bytes]
    kind: PageKind
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., pages: _Optional[_Iterable[bytes]] = ..., kind: _Optional[_Union[PageKind, str]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_present", "evicted")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    evicted: int
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "max_chunk_bytes", "local_only")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    local_only: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ..., local_only: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("keys", "pages", "missing_keys")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    MISSING_KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pages: _containers.RepeatedScalarFieldContainer[bytes]
    missing_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., pages: _Optional[_Iterable[bytes]] = ..., missing_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "record", "lease_ttl_seconds", "lease_id", "claim_seconds", "claim_node_id", "claim_start")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_START_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    record: bool
    lease_ttl_seconds: float
    lease_id: str
    claim_seconds: float
    claim_node_id: str
    claim_start: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., record: _Optional[bool] = ..., lease_ttl_seconds: _Optional[float] = ..., lease_id: _Optional[str] = ..., claim_seconds: _Optional[float] = ..., claim_node_id: _Optional[str] = ..., claim_start: _Optional[int] = ...) -> None: ...

class NodePrefix(_message.Message):
    __slots__ = ("node_id", "address", "prefix_length", "pending", "expires_in_seconds", "computing", "ready_in_seconds", "copies_ahead", "pool_length")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTING_FIELD_NUMBER: _ClassVar[int]
    READY_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    POOL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    prefix_length: int
    pending: bool
    expires_in_seconds: float
    computing: bool
    ready_in_seconds: float
    copies_ahead: int
    pool_length: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., prefix_length: _Optional[int] = ..., pending: _Optional[bool] = ..., expires_in_seconds: _Optional[float] = ..., computing: _Optional[bool] = ..., ready_in_seconds: _Optional[float] = ..., copies_ahead: _Optional[int] = ..., pool_length: _Optional[int] = ...) -> None: ...

class TierRun(_message.Message):
    __slots__ = ("tier", "pages", "load_seconds")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    pages: int
    load_seconds: float
    def __init__(self, tier: _Optional[str] = ..., pages: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "nodes", "lease_id", "leased_length", "lease_expires_in_seconds", "tiers")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodePrefix]
    lease_id: str
    leased_length: int
    lease_expires_in_seconds: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierRun]
    def __init__(self, prefix_length: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodePrefix, _Mapping]]] = ..., lease_id: _Optional[str] = ..., leased_length: _Optional[int] = ..., lease_expires_in_seconds: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierRun, _Mapping]]] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "not_found", "pinned")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    not_found: _containers.RepeatedScalarFieldContainer[bytes]
    pinned: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, deleted: _Optional[int] = ..., not_found: _Optional[_Iterable[bytes]] = ..., pinned: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "keys", "ttl_seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_seconds: float
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("lease_id", "pinned_keys", "missing_keys", "expires_in_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_KEYS_FIELD_NUMBER: _ClassVar[int]
    MISSING_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    pinned_keys: _containers.RepeatedScalarFieldContainer[bytes]
    missing_keys: _containers.RepeatedScalarFieldContainer[bytes]
    expires_in_seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., pinned_keys: _Optional[_Iterable[bytes]] = ..., missing_keys: _Optional[_Iterable[bytes]] = ..., expires_in_seconds: _Optional[float] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("namespace", "lease_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    lease_id: str
    def __init__(self, namespace: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "page_bytes", "capacity_bytes", "used_bytes", "num_slots", "used_slots", "pinned_slots", "speculative_slots", "hits", "misses", "puts", "evictions", "active_leases", "remote_hits", "replica_slots", "speculative_hits", "speculative_wasted_bytes")
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_HITS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_WASTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_bytes: int
    capacity_bytes: int
    used_bytes: int
    num_slots: int
    used_slots: int
    pinned_slots: int
    speculative_slots: int
    hits: int
    misses: int
    puts: int
    evictions: _containers.ScalarMap[str, int]
    active_leases: int
    remote_hits: int
    replica_slots: int
    speculative_hits: int
    speculative_wasted_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., page_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., pinned_slots: _Optional[int] = ..., speculative_slots: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., evictions: _Optional[_Mapping[str, int]] = ..., active_leases: _Optional[int] = ..., remote_hits: _Optional[int] = ..., replica_slots: _Optional[int] = ..., speculative_hits: _Optional[int] = ..., speculative_wasted_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "uptime_seconds", "capacity_bytes", "reserved_bytes", "namespaces", "device", "coordinator", "members", "pulls_in_flight", "claimed_keys", "tiers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PULLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    uptime_seconds: float
    capacity_bytes: int
    reserved_bytes: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    device: str
    coordinator: str
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    pulls_in_flight: int
    claimed_keys: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, node_id: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., capacity_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., device: _Optional[str] = ..., coordinator: _Optional[str] = ..., members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., pulls_in_flight: _Optional[int] = ..., claimed_keys: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "path", "io", "capacity_bytes", "used_bytes", "pages", "hits", "misses", "demotions", "promotions", "drops", "evictions", "corrupt", "bytes_written", "recovered", "degraded", "staged_bytes", "declined")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IO_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    path: str
    io: str
    capacity_bytes: int
    used_bytes: int
    pages: int
    hits: int
    misses: int
    demotions: int
    promotions: int
    drops: int
    evictions: int
    corrupt: int
    bytes_written: int
    recovered: int
    degraded: str
    staged_bytes: int
    declined: int
    def __init__(self, tier: _Optional[str] = ..., path: _Optional[str] = ..., io: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., drops: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ..., bytes_written: _Optional[int] = ..., recovered: _Optional[int] = ..., degraded: _Optional[str] = ..., staged_bytes: _Optional[int] = ..., declined: _Optional[int] = ...) -> None: ...

class NodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataEndpoint(_message.Message):
    __slots__ = ("protocol", "host", "port", "version", "path", "tls")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    host: str
    port: int
    version: int
    path: str
    tls: bool
    def __init__(self, protocol: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., version: _Optional[int] = ..., path: _Optional[str] = ..., tls: _Optional[bool] = ...) -> None: ...

class NodeInfoResponse(_message.Message):
    __slots__ = ("node_id", "version", "device", "max_message_bytes", "max_batch_pages", "max_batch_bytes", "max_pin_ttl_seconds", "data_endpoints")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PIN_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    device: str
    max_message_bytes: int
    max_batch_pages: int
    max_batch_bytes: int
    max_pin_ttl_seconds: float
    data_endpoints: _containers.RepeatedCompositeFieldContainer[DataEndpoint]
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., device: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., max_batch_pages: _Optional[int] = ..., max_batch_bytes: _Optional[int] = ..., max_pin_ttl_seconds: _Optional[float] = ..., data_endpoints: _Optional[_Iterable[_Union[DataEndpoint, _Mapping]]] = ...) -> None: ...

class DataHeader(_message.Message):
    __slots__ = ("op", "namespace", "keys", "page_bytes", "kind", "code", "message", "found", "put", "checksums", "local_only", "deadline_ms", "slots", "grant", "num_slots", "token", "ahead", "ahead_slots", "ahead_grant", "ahead_ms", "traceparent")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[DataHeader.Op]
        PUT: _ClassVar[DataHeader.Op]
        GET: _ClassVar[DataHeader.Op]
        RESULT: _ClassVar[DataHeader.Op]
        ATTACH: _ClassVar[DataHeader.Op]
        RELEASE: _ClassVar[DataHeader.Op]
        COMMIT: _ClassVar[DataHeader.Op]
        HELLO: _ClassVar[DataHeader.Op]
    OP_UNSPECIFIED: DataHeader.Op
    PUT: DataHeader.Op
    GET: DataHeader.Op
    RESULT: DataHeader.Op
    ATTACH: DataHeader.Op
    RELEASE: DataHeader.Op
    COMMIT: DataHeader.Op
    HELLO: DataHeader.Op
    OP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_GRANT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    op: DataHeader.Op
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    page_bytes: int
    kind: PageKind
    code: int
    message: str
    found: _containers.RepeatedScalarFieldContainer[bool]
    put: PutResponse
    checksums: _containers.RepeatedScalarFieldContainer[int]
    local_only: bool
    deadline_ms: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    grant: int
    num_slots: int
    token: str
    ahead: int
    ahead_slots: _containers.RepeatedScalarFieldContainer[int]
    ahead_grant: int
    ahead_ms: int
    traceparent: str
    def __init__(self, op: _Optional[_Union[DataHeader.Op, str]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., page_bytes: _Optional[int] = ..., kind: _Optional[_Union[PageKind, str]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., found: _Optional[_Iterable[bool]] = ..., put: _Optional[_Union[PutResponse, _Mapping]] = ..., checksums: _Optional[_Iterable[int]] = ..., local_only: _Optional[bool] = ..., deadline_ms: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., grant: _Optional[int] = ..., num_slots: _Optional[int] = ..., token: _Optional[str] = ..., ahead: _Optional[int] = ..., ahead_slots: _Optional[_Iterable[int]] = ..., ahead_grant: _Optional[int] = ..., ahead_ms: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class TransportEndpoint(_message.Message):
    __slots__ = ("kind", "host", "port")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    host: str
    port: int
    def __init__(self, kind: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class MemberInfo(_message.Message):
    __slots__ = ("node_id", "address", "incarnation", "endpoints", "capacity_bytes", "used_bytes", "hits", "misses", "remote_hits", "role", "last_seen_seconds_ago", "alive", "speculative_bytes", "cold_bytes", "cold_reads")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLD_READS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    incarnation: str
    endpoints: _containers.RepeatedCompositeFieldContainer[TransportEndpoint]
    capacity_bytes: int
    used_bytes: int
    hits: int
    misses: int
    remote_hits: int
    role: str
    last_seen_seconds_ago: float
    alive: bool
    speculative_bytes: int
    cold_bytes: int
    cold_reads: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., endpoints: _Optional[_Iterable[_Union[TransportEndpoint, _Mapping]]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., remote_hits: _Optional[int] = ..., role: _Optional[str] = ..., last_seen_seconds_ago: _Optional[float] = ..., alive: _Optional[bool] = ..., speculative_bytes: _Optional[int] = ..., cold_bytes: _Optional[int] = ..., cold_reads: _Optional[float] = ...) -> None: ...

class DirectoryBatch(_message.Message):
    __slots__ = ("namespace", "adds", "removes", "speculative", "below")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ADDS_FIELD_NUMBER: _ClassVar[int]
    REMOVES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    BELOW_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    adds: _containers.RepeatedScalarFieldContainer[bytes]
    removes: _containers.RepeatedScalarFieldContainer[bytes]
    speculative: _containers.RepeatedCompositeFieldContainer[SpeculativePage]
    below: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., adds: _Optional[_Iterable[bytes]] = ..., removes: _Optional[_Iterable[bytes]] = ..., speculative: _Optional[_Iterable[_Union[SpeculativePage, _Mapping]]] = ..., below: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SpeculativePage(_message.Message):
    __slots__ = ("key", "expires_in_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    expires_in_seconds: float
    def __init__(self, key: _Optional[bytes] = ..., expires_in_seconds: _Optional[float] = ...) -> None: ...

class AccessEvent(_message.Message):
    __slots__ = ("namespace", "keys", "age_seconds", "outcome", "total_blocks", "local_blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    age_seconds: float
    outcome: int
    total_blocks: int
    local_blocks: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., age_seconds: _Optional[float] = ..., outcome: _Optional[int] = ..., total_blocks: _Optional[int] = ..., local_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("sender", "known", "has_directory", "seq", "full", "directory", "accesses")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    HAS_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    ACCESSES_FIELD_NUMBER: _ClassVar[int]
    sender: MemberInfo
    known: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    has_directory: bool
    seq: int
    full: bool
    directory: _containers.RepeatedCompositeFieldContainer[DirectoryBatch]
    accesses: _containers.RepeatedCompositeFieldContainer[AccessEvent]
    def __init__(self, sender: _Optional[_Union[MemberInfo, _Mapping]] = ..., known: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., has_directory: _Optional[bool] = ..., seq: _Optional[int] = ..., full: _Optional[bool] = ..., directory: _Optional[_Iterable[_Union[DirectoryBatch, _Mapping]]] = ..., accesses: _Optional[_Iterable[_Union[AccessEvent, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("receiver", "known", "need_full", "accepted_seq")
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NEED_FULL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    receiver: MemberInfo
    known: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    need_full: bool
    accepted_seq: int
    def __init__(self, receiver: _Optional[_Union[MemberInfo, _Mapping]] = ..., known: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., need_full: _Optional[bool] = ..., accepted_seq: _Optional[int] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KeyHolders(_message.Message):
    __slots__ = ("node_ids",)
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("holders", "members")
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[KeyHolders]
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    def __init__(self, holders: _Optional[_Iterable[_Union[KeyHolders, _Mapping]]] = ..., members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("node_id", "coordinator", "members", "joining")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    coordinator: str
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    joining: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., coordinator: _Optional[str] = ..., members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., joining: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("namespace", "keys", "source_node_id", "kind", "ttl_seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    source_node_id: str
    kind: PageKind
    ttl_seconds: float
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., source_node_id: _Optional[str] = ..., kind: _Optional[_Union[PageKind, str]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class DropSpeculativeRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DropSpeculativeResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("copied", "already_present", "missing")
    COPIED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    copied: int
    already_present: int
    missing: int
    def __init__(self, copied: _Optional[int] = ..., already_present: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...
