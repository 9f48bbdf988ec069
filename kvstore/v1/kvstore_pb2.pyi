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
    __slots__ = ("namespace", "keys", "max_chunk_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class NodePrefix(_message.Message):
    __slots__ = ("node_id", "address", "prefix_length")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    prefix_length: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., prefix_length: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "nodes")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodePrefix]
    def __init__(self, prefix_length: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodePrefix, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("namespace", "page_bytes", "capacity_bytes", "used_bytes", "num_slots", "used_slots", "pinned_slots", "speculative_slots", "hits", "misses", "puts", "evictions", "active_leases")
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
    def __init__(self, namespace: _Optional[str] = ..., page_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., pinned_slots: _Optional[int] = ..., speculative_slots: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., evictions: _Optional[_Mapping[str, int]] = ..., active_leases: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "uptime_seconds", "capacity_bytes", "reserved_bytes", "namespaces", "device")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    uptime_seconds: float
    capacity_bytes: int
    reserved_bytes: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    device: str
    def __init__(self, node_id: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., capacity_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., device: _Optional[str] = ...) -> None: ...

class NodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataEndpoint(_message.Message):
    __slots__ = ("protocol", "host", "port", "version")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    host: str
    port: int
    version: int
    def __init__(self, protocol: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("op", "namespace", "keys", "page_bytes", "kind", "code", "message", "found", "put")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[DataHeader.Op]
        PUT: _ClassVar[DataHeader.Op]
        GET: _ClassVar[DataHeader.Op]
        RESULT: _ClassVar[DataHeader.Op]
    OP_UNSPECIFIED: DataHeader.Op
    PUT: DataHeader.Op
    GET: DataHeader.Op
    RESULT: DataHeader.Op
    OP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    op: DataHeader.Op
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    page_bytes: int
    kind: PageKind
    code: int
    message: str
    found: _containers.RepeatedScalarFieldContainer[bool]
    put: PutResponse
    def __init__(self, op: _Optional[_Union[DataHeader.Op, str]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., page_bytes: _Optional[int] = ..., kind: _Optional[_Union[PageKind, str]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., found: _Optional[_Iterable[bool]] = ..., put: _Optional[_Union[PutResponse, _Mapping]] = ...) -> None: ...
