"""The HTTP front's OpenAPI 3.1 document (GET /openapi.json), made from the proto's descriptors so that it cannot
drift from the messages: each message a schema under protobuf's JSON mapping (lowerCamelCase names, 64-bit
integers as strings, enums by name; docs/api.md has each field's meaning), each route of server/http.py a path, and
LibreTranslate's two routes as LibreTranslate documents them."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

import nmtserve
from nmtserve.v1 import translation_pb2 as pb

_F = FieldDescriptor
_SCALARS = {
    _F.TYPE_STRING: {"type": "string"}, _F.TYPE_BOOL: {"type": "boolean"}, _F.TYPE_BYTES: {"type": "string"},
    _F.TYPE_FLOAT: {"type": "number"}, _F.TYPE_DOUBLE: {"type": "number"},
    **{t: {"type": "integer"} for t in (_F.TYPE_INT32, _F.TYPE_UINT32, _F.TYPE_SINT32, _F.TYPE_FIXED32,
                                         _F.TYPE_SFIXED32)},
    **{t: {"type": "string", "format": "int64"} for t in (_F.TYPE_INT64, _F.TYPE_UINT64, _F.TYPE_SINT64,
                                                           _F.TYPE_FIXED64, _F.TYPE_SFIXED64)},
}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["code", "status", "message"],
    "properties": {"code": {"type": "integer", "description": "the HTTP status"},
                   "status": {"type": "string", "description": "gRPC's status code, e.g. INVALID_ARGUMENT"},
                   "message": {"type": "string", "description": "what was wrong, naming the field"}}}}}
_LIBRE_REQUEST = {"type": "object", "required": ["q", "target"], "properties": {
    "q": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "source": {"type": "string", "description": "a language code, or auto (the default): detected among those served"},
    "target": {"type": "string"},
    "format": {"type": "string", "enum": ["text", "html"], "description": "html is refused (400) until markup is kept"},
    "alternatives": {"type": "integer", "minimum": 0},
    "api_key": {"type": "string"}}}
_DETECTED = {"type": "object", "properties": {"confidence": {"type": "number", "minimum": 0, "maximum": 100},
                                              "language": {"type": "string"}}}
_LIBRE_RESPONSE = {"type": "object", "required": ["translatedText"], "properties": {
    "translatedText": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "alternatives": {"type": "array", "items": {}},
    "detectedLanguage": {"oneOf": [_DETECTED, {"type": "array", "items": _DETECTED}]}}}
_HEALTH = {"type": "object", "required": ["status"], "properties": {
    "status": {"type": "string", "enum": ["SERVING", "NOT_SERVING"]}}}
_LANGUAGES = {"type": "array", "items": {"type": "object", "required": ["code", "name", "targets"], "properties": {
    "code": {"type": "string"}, "name": {"type": "string"}, "targets": {"type": "array", "items": {"type": "string"}}}}}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _schema(message: Descriptor, schemas: dict) -> dict:
    """A reference to the message's schema, added to `schemas` (with those of the messages it holds) once."""
    if message.name not in schemas:
        schemas[message.name] = {}  # taken, for a message that holds itself
        properties = {}
        for field in message.fields:
            if field.message_type is not None:
                value = _schema(field.message_type, schemas)
            elif field.enum_type is not None:
                value = {"type": "string", "enum": [v.name for v in field.enum_type.values]}
            else:
                value = dict(_SCALARS[field.type])
            properties[field.json_name] = {"type": "array", "items": value} if field.is_repeated else value
        schemas[message.name] = {"type": "object", "properties": properties}
    return _ref(message.name)


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(schema: dict) -> dict:
    return {"default": {"description": "an error: gRPC's status as HTTP's, the message naming the field", **_json(schema)}}


def openapi_document() -> dict:
    schemas: dict = {}
    timeout = {"name": "X-Server-Timeout", "in": "header", "required": False,
               "description": "the call's deadline, in seconds (DEADLINE_EXCEEDED, 504, past it)",
               "schema": {"type": "number", "exclusiveMinimum": 0}}
    paths = {}
    for path, request, response, summary in (
            ("/v1/translate", pb.TranslateRequest, pb.TranslateResponse, "Translate sentences (the Translate RPC)"),
            ("/v1/translateText", pb.TranslateTextRequest, pb.TranslateTextResponse,
             "Translate whole texts, split into sentences by the server (the TranslateText RPC)")):
        paths[path] = {"post": {"summary": summary, "parameters": [timeout],
                                "requestBody": {"required": True, **_json(_schema(request.DESCRIPTOR, schemas))},
                                "responses": {"200": {"description": "the translations",
                                                      **_json(_schema(response.DESCRIPTOR, schemas))},
                                              **_errors(_ref("Error"))}}}
    for path, request, event, summary in (
            ("/v1/translate:stream", pb.TranslateStreamRequest, pb.TranslateStreamResponse,
             "Translate one sentence, streamed (the TranslateStream RPC)"),
            ("/v1/translateText:stream", pb.TranslateTextStreamRequest, pb.TranslateTextStreamResponse,
             "Translate one text, streamed sentence by sentence (the TranslateTextStream RPC)")):
        paths[path] = {"post": {
            "summary": summary, "parameters": [timeout],
            "requestBody": {"required": True, **_json(_schema(request.DESCRIPTOR, schemas))},
            "responses": {"200": {"description": f"server-sent events: each event's data one {event.DESCRIPTOR.name} "
                                                 "as JSON; an error after the first event is an `error` event whose "
                                                 "data is the error body",
                                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                          **_errors(_ref("Error"))}}}
    paths["/v1/models"] = {"get": {"summary": "Every served model (the ListModels RPC)", "responses": {
        "200": {"description": "the models", **_json(_schema(pb.ListModelsResponse.DESCRIPTOR, schemas))}}}}
    paths["/v1/models/{model}"] = {"get": {
        "summary": "One served model (the GetModelInfo RPC)",
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the model", **_json(_schema(pb.ModelInfo.DESCRIPTOR, schemas))},
                      **_errors(_ref("Error"))}}}
    paths["/translate"] = {"post": {
        "summary": "LibreTranslate's translate", "parameters": [timeout],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _LIBRE_REQUEST},
                                                      "application/x-www-form-urlencoded": {"schema": _LIBRE_REQUEST}}},
        "responses": {"200": {"description": "the translations", **_json(_LIBRE_RESPONSE)},
                      **_errors({"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}})}}}
    paths["/languages"] = {"get": {"summary": "LibreTranslate's languages: each source language and its targets",
                                   "responses": {"200": {"description": "the languages", **_json(_LANGUAGES)}}}}
    for path, summary in (("/livez", "Liveness: 200 while the process answers, draining or not"),
                          ("/readyz", "Readiness: 200 while the server takes calls, 503 from the start of its drain")):
        paths[path] = {"get": {"summary": summary, "responses": {
            "200": {"description": "status", **_json(_HEALTH)}, "503": {"description": "draining", **_json(_HEALTH)}}}}
    paths["/openapi.json"] = {"get": {"summary": "This document",
                                      "responses": {"200": {"description": "OpenAPI 3.1", **_json({"type": "object"})}}}}
    schemas["Error"] = _ERROR
    return {"openapi": "3.1.0",
            "info": {"title": "nmtserve", "version": nmtserve.__version__,
                     "description": "The gRPC service nmtserve.v1.TranslationService as JSON over HTTP, and "
                                    "LibreTranslate's API. Field meanings: docs/api.md."},
            "paths": paths, "security": [{"apiKey": []}, {}],
            "components": {"schemas": schemas, "securitySchemes": {"apiKey": {
                "type": "http", "scheme": "bearer",
                "description": "where the server has --api-keys: `authorization: Bearer KEY` (401 without a known key, "
                               "403 for a model the key's client may not use, 429 with Retry-After over its quota)"}}}}
