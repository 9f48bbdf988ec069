"""Traces across nodes: two real nodes (in this process, so the SDK's in-memory exporter sees both), a Get
on one for pages the other holds, and a Replicate started inside a caller's trace. The spans join one
trace: the Get (or Replicate) on b, the pull it made, and a's serving of that pull, each the parent of
the next, the context carried in gRPC metadata and in the peer transport's frame header."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvstore import tracing
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import KvClient
from tests.conftest import keys_for, random_pages, wait_until

PAGE = 64 << 10


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first SDK provider of this process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    yield exporter
    processor.shutdown()


def _one(finished: list[Any], name: str, **attrs: Any) -> Any:
    found = [s for s in finished if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, [(s.name, dict(s.attributes)) for s in finished]
    return found[0]


def _child_of(child: Any, parent: Any) -> None:
    assert child.context.trace_id == parent.context.trace_id, (child.name, parent.name)
    assert child.parent is not None and child.parent.span_id == parent.context.span_id, (child.name, parent.name)


@pytest.fixture
def two_nodes(make_server):  # type: ignore[no-untyped-def]
    a = make_server(node_id="a", transport="tcp", heartbeat_interval=0.1, heartbeat_timeout=2.0)
    b = make_server(node_id="b", transport="tcp", peers=(a.address,), heartbeat_interval=0.1, heartbeat_timeout=2.0)
    wait_until(lambda: b.call(lambda: len(b.server.agent.membership.live_ids())) == 2, 10, "membership")
    return a, b


def _held_by_a(a, b, namespace: str, keys: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    """``namespace`` on both nodes, ``keys`` put on a."""
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.create_namespace(namespace, PAGE)
        kb.create_namespace(namespace, PAGE)
        ka.put(namespace, keys, random_pages(len(keys), PAGE))


def _pulled_under(finished: list[Any], parent: Any) -> Any:
    """b's pull is ``parent``'s child and a's serving of it the pull's (across the nodes, in the transport's
    frame header); returns the pull."""
    pull = _one(finished, "kvstore.pull")
    _child_of(pull, parent)
    _child_of(_one(finished, "kvstore.serve_pull"), pull)
    return pull


def test_a_get_its_pull_and_the_serving_node_share_one_trace(two_nodes, spans) -> None:  # type: ignore[no-untyped-def]
    a, b = two_nodes
    keys = keys_for(4, b"traced")
    _held_by_a(a, b, "m", keys)
    with KvClient(b.address) as kb:
        wait_until(lambda: kb.lookup_nodes("m", keys).nodes, 5, "the directory to show a's pages")
        spans.clear()
        assert kb.get("m", keys).found.all()  # b pulls all four from a
    # the client has its reply a moment before the node's handler ends its span
    wait_until(lambda: any(s.name == "kvstore.get" for s in spans.get_finished_spans()), 5, "the Get's span")
    finished = spans.get_finished_spans()
    get = next(s for s in finished if s.name == "kvstore.get")
    pull = _pulled_under(finished, get)
    assert pull.attributes["kvstore.source"] == "a"
    assert get.kind == trace.SpanKind.SERVER and pull.kind == trace.SpanKind.CLIENT


def test_a_replicate_joins_its_callers_trace(two_nodes, spans) -> None:  # type: ignore[no-untyped-def]
    a, b = two_nodes
    keys = keys_for(3, b"copied")
    _held_by_a(a, b, "n", keys)
    spans.clear()
    with tracing.TRACER.start_as_current_span("caller") as caller:
        with grpc.insecure_channel(b.address) as channel:  # the coordinator's call, as a caller in a trace makes it
            reply = pb_grpc.ClusterStub(channel).Replicate(
                pb.ReplicateRequest(namespace="n", keys=keys, source_node_id="a", kind=pb.REPLICA),
                metadata=tracing.metadata(), timeout=10)
    assert reply.copied == 3
    finished = spans.get_finished_spans()
    replicate = _one(finished, "kvstore.replicate")
    assert replicate.parent is not None and replicate.parent.span_id == caller.get_span_context().span_id
    _pulled_under(finished, replicate)


def test_without_a_configured_sdk_nothing_is_set_up() -> None:
    assert tracing.configure("kvstored", "n0", environ={}) == ""
    assert tracing.configure("kvstored", "n0", environ={"OTEL_TRACES_EXPORTER": "none",
                                                        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}) == ""
    assert tracing.context_from("") is None and tracing.context_from(()) is None
