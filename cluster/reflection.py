"""gRPC server reflection, as both ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection ships only v1alpha; current tools (grpcurl, Postman,
grpcui) ask for v1 first. The two services' messages are the same on the
wire (v1 is v1alpha renamed), so one servicer answers both: v1 calls are
decoded and encoded with the v1alpha messages. v1's descriptor, for clients
that describe the reflection service itself, is v1alpha's with the package
renamed, added to the default descriptor pool.
"""
from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    old = v1alpha_pb2.DESCRIPTOR.package
    fdp = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = V1_FILE, V1_PACKAGE
    fdp.ClearField("options")
    renamed = lambda name: name.replace(f".{old}.", f".{V1_PACKAGE}.", 1)  # noqa: E731
    for message in fdp.message_type:
        for f in message.field:
            if f.type_name:
                f.type_name = renamed(f.type_name)
    for service in fdp.service:
        for method in service.method:
            method.input_type, method.output_type = renamed(method.input_type), renamed(method.output_type)
    pool.Add(fdp)


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) on ``server`` for ``service_names`` and the reflection services."""
    _add_v1_descriptor(descriptor_pool.Default())
    names = tuple(service_names) + (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
        for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)))
