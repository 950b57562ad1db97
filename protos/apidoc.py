"""docs/api.md from the .proto's own comments: every RPC, message, field and enum value, in the file's order.

    python protos/apidoc.py > docs/api.md      # make protos; tests/server/test_protos.py checks it is current

protoc (grpc_tools) compiles the file with its source info, and each element's leading comment is its
description, so the reference cannot say something the .proto does not.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

PROTO = "nmtserve/v1/translation.proto"
ROOT = Path(__file__).resolve().parent

# the gRPC status codes the server answers with, and when (server/service.py's status_of and _EARLY_FINISH), and the
# HTTP front's code for each (server/http_status.py)
STATUS_CODES = (
    ("OK", "the call succeeded; each sentence's finish_reason says how it ended"),
    ("INVALID_ARGUMENT", "a field is out of its range, or names a language its model does not serve; the message "
                         "starts with the field's name and its value (HTTP 400)"),
    ("UNAUTHENTICATED", "the server has API keys (--api-keys) and the call sends none (`authorization: Bearer KEY`) "
                        "or one it does not know (HTTP 401)"),
    ("PERMISSION_DENIED", "the call's API key is a client's that may not use the model it asks for (HTTP 403)"),
    ("NOT_FOUND", "no served model is the one named, or serves the language pair asked for; the message lists "
                  "what is served (HTTP 404)"),
    ("RESOURCE_EXHAUSTED", "the model's waiting queue is full (--max-waiting), the call's client is over its quota "
                           "(`max_concurrent`, `chars_per_minute`: [serving.md](serving.md#quotas)), or a response "
                           "would exceed --max-message-bytes; when waiting helps, the `retry-after` trailer (gRPC) or "
                           "Retry-After header (HTTP 429) says how many seconds"),
    ("UNAVAILABLE", "the server is draining on SIGTERM (its health check says NOT_SERVING); retry on another replica (HTTP 503)"),
    ("DEADLINE_EXCEEDED", "the client's deadline passed; the sentence's rows were freed (HTTP 504)"),
    ("CANCELLED", "the client cancelled the call; the sentence's rows were freed (HTTP 499)"),
    ("INTERNAL", "a failure in the engine, confined to the sentences whose rows failed; others in the batch go on (HTTP 500)"),
)


def descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The .proto compiled by protoc with its comments (source info)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        code = protoc.main(["protoc", f"-I{ROOT}", "--include_source_info", f"--descriptor_set_out={out}", PROTO])
        if code != 0:
            raise RuntimeError(f"protoc failed on {ROOT / PROTO} (exit {code})")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


def _comment(comments: dict, path: tuple) -> str:
    return " ".join(line.strip() for line in comments.get(path, "").strip().splitlines())


def _type_name(field: descriptor_pb2.FieldDescriptorProto) -> str:
    kinds = {v: k.removeprefix("TYPE_").lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}
    name = field.type_name.rsplit(".", 1)[-1] if field.type_name else kinds[field.type]
    repeated = field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    return f"repeated {name}" if repeated else f"optional {name}" if field.proto3_optional else name


def markdown(file: descriptor_pb2.FileDescriptorProto) -> str:
    comments = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location if loc.leading_comments}
    out = ["# API reference", "",
           f"Generated from `protos/{PROTO}` by `protos/apidoc.py` (`make protos`); the descriptions are the "
           ".proto's own comments. Package `nmtserve.v1`; gRPC health (`grpc.health.v1`) and server reflection are "
           "served too. Field names are the JSON names as well (protobuf's JSON mapping, `preserving_proto_field_name`).",
           ""]
    for s, service in enumerate(file.service):
        out += [f"## Service {service.name}", "", _comment(comments, (6, s)), "", "| RPC | request | response | |",
                "|---|---|---|---|"]
        for m, method in enumerate(service.method):
            response = ("stream " if method.server_streaming else "") + method.output_type.rsplit(".", 1)[-1]
            out.append(f"| `{method.name}` | {method.input_type.rsplit('.', 1)[-1]} | {response} | "
                       f"{_comment(comments, (6, s, 2, m))} |")
        out.append("")
    out += ["## Status codes", "", "| code | when |", "|---|---|"]
    out += [f"| `{code}` | {when} |" for code, when in STATUS_CODES]
    out += [""]
    for i, message in enumerate(file.message_type):
        out += [f"## {message.name}", "", _comment(comments, (4, i)), ""]
        if not message.field:
            out += ["No fields.", ""]
            continue
        out += ["| field | number | type | |", "|---|---:|---|---|"]
        for j, field in enumerate(message.field):
            out.append(f"| `{field.name}` | {field.number} | {_type_name(field)} | {_comment(comments, (4, i, 2, j))} |")
        out.append("")
    for i, enum in enumerate(file.enum_type):
        out += [f"## {enum.name} (enum)", "", _comment(comments, (5, i)), "", "| value | number | |", "|---|---:|---|"]
        for j, value in enumerate(enum.value):
            out.append(f"| `{value.name}` | {value.number} | {_comment(comments, (5, i, 2, j))} |")
        out.append("")
    return "\n".join(line for line in out).replace("\n\n\n", "\n\n").rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown(descriptor()))
