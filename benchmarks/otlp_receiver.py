"""A real OTLP/gRPC trace receiver: the collector's TraceService built from opentelemetry-proto's
generated stubs, keeping every span it is sent. Tests read the spans it got; benchmarks run it as
a process so that exported spans cost what they cost against a collector.

    python benchmarks/otlp_receiver.py --address 127.0.13.1:24317    # counts spans, prints them on exit
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver") -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the gRPC method's name)
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(s.name, str(resource.get("service.name", "")), s.trace_id.hex(),
                                              s.span_id.hex(), s.parent_span_id.hex(),
                                              {a.key: _value(a.value) for a in s.attributes}))
        with self.receiver.lock:
            self.receiver.spans.extend(spans)
            self.receiver.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """An OTLP/gRPC endpoint on `address` (host:port, loopback); `spans` grows as exports arrive."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        if self.server.add_insecure_port(address) == 0:
            raise OSError(f"cannot listen on {address}")

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}"

    def start(self) -> "OtlpReceiver":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=1).wait()

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True, help="host:port on loopback")
    args = ap.parse_args()
    receiver = OtlpReceiver(args.address).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    receiver.stop()
    print(f"spans {len(receiver.spans)} exports {receiver.exports}", flush=True)


if __name__ == "__main__":
    main()
