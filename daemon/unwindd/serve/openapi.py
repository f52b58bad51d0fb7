"""The daemon's HTTP API described as OpenAPI 3.0 (served at ``/v1/openapi.json``), generated
from the lists the handlers themselves check, so the description cannot drift from them.

Invariants:
- Paths are ``api.PARAMS``'s (the socket's routes) plus the pull export's
  (``pprofpull.INDEX``, ``pprofpull.PROFILE``, ``pprofpull.pull_params``) and the metrics
  listener's ``/metrics``; each of the latter carries its own ``servers`` entry (a TCP
  listener named by its config key), so a client of the socket knows it is not there.
- Each operation lists exactly the parameters its endpoint takes: ``PARAMS[path]`` and
  nothing else (anything else is answered 400 ``unknown_parameter``). A parameter without a
  description here fails ``spec()`` (KeyError) and so the unit test: adding one to
  ``PARAMS`` means describing it.
- Every error answer is ``ERROR`` (``httpapi.error_response``'s body) with its status.
- Response schemas name the fields clients rely on and allow more (objects are open), so a new
  field is no breaking change.
- Cost: built once per process (``spec_bytes``, cached), O(endpoints x parameters).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any, Final

from .. import __version__
from .api import FILTER_PARAMS, PARAMS
from .pprofpull import INDEX, PROFILE, pull_params

OPENAPI_PATH: Final = "/v1/openapi.json"

JSON: Final = "application/json"
PPROF: Final = "application/vnd.google.protobuf+gzip"

# An empty value (``?tid=``) is taken as the parameter's absence (api._int, float_param).
_EMPTY: Final = {"type": "string", "enum": [""]}
_QINT: Final = {"oneOf": [{"type": "integer"}, _EMPTY]}
_NUM0: Final = {"oneOf": [{"type": "number", "minimum": 0}, _EMPTY]}
_INT: Final = {"type": "integer"}

# name -> (schema, description) of every parameter some endpoint takes.
PARAM_DOCS: Final[dict[str, tuple[dict[str, Any], str]]] = {
    "since": (_NUM0, "window start, seconds before now"),
    "until": (_NUM0, "window end, seconds before now (after since)"),
    "since_ns": (_QINT, "window start, CLOCK_MONOTONIC ns (as /v1/status's now_ns)"),
    "until_ns": (_QINT, "window end, CLOCK_MONOTONIC ns"),
    # One pid or several: a query string cannot tell a one-item array from its item, so
    # both are valid (else a negative case "not an array" would be sent as a valid query).
    "pid": ({"oneOf": [_QINT, {"type": "array", "items": _QINT}]},
            "process ids (repeatable, or comma-separated); a non-root peer sees its own only"),
    "tid": (_QINT, "thread id"),
    "comm": ({"type": "string"}, "command name (the kernel's comm)"),
    "unit": ({"type": "string"}, "systemd unit of the process (e.g. nginx.service)"),
    "container": ({"type": "string", "pattern": "^[A-Za-z0-9]*$"},
                  "container id, or its first digits"),
    "cgroup": ({"type": "string", "pattern": "^(/.*)?$"},
               "cgroup v2 path; the processes in it or below it"),
    "format": ({"type": "string", "enum": ["json", "folded", "pprof"], "default": "json"},
               "json; folded (flamegraph.pl input, text/plain); pprof (gzipped protobuf)"),
    "limit": ({"oneOf": [{"type": "integer", "minimum": 1}, _EMPTY]}, "at most this many items"),
    "seconds": (_NUM0, "how long"),
    "inline": ({"type": "string", "enum": ["0", "1", ""], "default": "1"},
               "1: functions the compiler inlined are frames of their own (DWARF); 0: the "
               "frames without them (perf script --no-inline), each frame's line its own pc's"),
    "by": ({"type": "string", "enum": ["function", "line", ""], "default": "function"},
           "function: counts per function (functions); line: per source file:line and "
           "function (lines)"),
}  # fmt: skip

# Per endpoint, what a parameter means there when it differs from PARAM_DOCS.
_PARAM_NOTES: Final[dict[tuple[str, str], str]] = {
    ("/v1/processes", "limit"): "at most this many processes, most samples first (default 1000)",
    ("/v1/stacks", "limit"): "at most this many stacks, largest counts first (default and cap: "
                             "[api] max_stacks)",
    ("/v1/top", "limit"): "at most this many functions or lines (default 50, cap 1000)",
    ("/v1/stream", "limit"): "end the stream after this many samples",
    ("/v1/stream", "seconds"): "end the stream after this many seconds (default: never)",
    (PROFILE, "seconds"): "the profile's length: blocks this long, then answers (default 30, "
                          "at most [export] pprof_max_seconds)",
}  # fmt: skip

ERROR: Final = {
    "type": "object",
    "required": ["error", "status"],
    "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
}

_NSTR: Final = {"type": "string", "nullable": True}
_NINT: Final = {"type": "integer", "nullable": True}

WINDOW: Final = {
    "type": "object",
    "required": ["from", "to", "seconds", "from_ns", "to_ns"],
    "properties": {"from": {"type": "string", "format": "date-time"},
                   "to": {"type": "string", "format": "date-time"},
                   "seconds": {"type": "number"}, "from_ns": _INT, "to_ns": _INT},
}  # fmt: skip

FRAME: Final = {
    "type": "object",
    "required": ["ip", "sym", "dso", "kernel"],
    "properties": {"ip": {"type": "string", "pattern": "^0x[0-9a-f]+$"}, "sym": _NSTR,
                   "dso": _NSTR, "offset": _NINT, "kernel": {"type": "boolean"},
                   "rel": {"type": "string", "pattern": "^0x[0-9a-f]+$"},
                   "inlined": {"type": "boolean"}, "file": {"type": "string"}, "line": _NINT},
}  # fmt: skip

STACKS: Final = {
    "type": "object",
    "required": ["samples", "truncated", "stacks", "window"],
    "properties": {
        "samples": _INT, "truncated": {"type": "boolean"}, "window": {"$ref": "#/components/"
                                                                             "schemas/Window"},
        "stacks": {"type": "array", "items": {
            "type": "object", "required": ["pid", "tid", "comm", "count", "frames"],
            "properties": {"pid": _NINT, "tid": _NINT, "comm": _NSTR, "count": _INT,
                           "frames": {"type": "array",
                                      "items": {"$ref": "#/components/schemas/Frame"}}}}},
    },
}  # fmt: skip

TOP: Final = {
    "type": "object",
    "required": ["samples", "window"],
    "properties": {
        "samples": _INT, "window": {"$ref": "#/components/schemas/Window"},
        "functions": {"type": "array", "items": {
            "type": "object", "required": ["sym", "dso", "self", "total"],
            "properties": {"sym": _NSTR, "dso": _NSTR, "self": _INT, "total": _INT}}},
        "lines": {"type": "array", "items": {
            "type": "object", "required": ["file", "line", "sym", "dso", "self", "total"],
            "properties": {"file": _NSTR, "line": _NINT, "sym": _NSTR, "dso": _NSTR,
                           "self": _INT, "total": _INT}}},
    },
}  # fmt: skip

PROCESSES: Final = {
    "type": "object",
    "required": ["processes", "truncated"],
    "properties": {
        "truncated": {"type": "boolean"},
        "processes": {"type": "array", "items": {
            "type": "object",
            "required": ["pid", "comm", "exe", "samples", "last_seen_ns", "cgroup", "unit",
                         "container_id"],
            "properties": {"pid": _INT, "comm": _NSTR, "exe": _NSTR, "samples": _INT,
                           "last_seen_ns": _INT, "cgroup": _NSTR, "unit": _NSTR,
                           "container_id": _NSTR}}},
    },
}  # fmt: skip

STATUS: Final = {
    "type": "object",
    "required": ["version", "pid", "uptime_s", "now_ns", "samples", "unwound", "lost",
                 "lost_samples", "throttled", "processes", "store", "api", "config"],
    "properties": {"version": {"type": "string"}, "pid": _INT, "uptime_s": {"type": "number"},
                   "tick_ms": _INT,
                   "now_ns": _INT, "samples": _INT, "unwound": _INT, "lost": _INT,
                   "lost_samples": _INT, "throttled": _INT, "processes": _INT,
                   "store": {"type": "object"}, "api": {"type": "object"},
                   "config": {"type": "object"}},
}  # fmt: skip

INDEX_SCHEMA: Final = {
    "type": "object",
    "required": ["endpoints", "parameters"],
    "properties": {"endpoints": {"type": "array", "items": {"type": "string"}},
                   "parameters": {"type": "object", "additionalProperties": {
                       "type": "array", "items": {"type": "string"}}}},
}  # fmt: skip

_WINDOW_HEADERS: Final = {
    "x-unwindd-window-from": "start of the window the counts cover (UTC, ISO 8601)",
    "x-unwindd-window-to": "end of the window (UTC, ISO 8601)",
    "x-unwindd-window-seconds": "the window's length",
}

# path -> (summary, {media type: schema}) of its 200 answer; the socket's endpoints.
_OK: Final[dict[str, tuple[str, dict[str, dict[str, Any]]]]] = {
    "/": ("The endpoints and the parameters each takes",
          {JSON: {"$ref": "#/components/schemas/Index"}}),
    "/v1/status": ("Version, uptime, sample and loss counters, caches, the effective config",
                   {JSON: {"$ref": "#/components/schemas/Status"}}),
    "/v1/processes": ("Processes with samples in the store, most samples first",
                      {JSON: {"$ref": "#/components/schemas/Processes"}}),
    "/v1/stacks": ("Stacks and their sample counts in a window",
                   {JSON: {"$ref": "#/components/schemas/Stacks"},
                    "text/plain": {"type": "string"},
                    PPROF: {"type": "string", "format": "binary"}}),
    "/v1/top": ("Functions (or source lines) by self and total samples in a window",
                {JSON: {"$ref": "#/components/schemas/Top"}}),
    "/v1/stream": ("Unwound samples as they arrive: chunked, one JSON object per line",
                   {"application/x-ndjson": {"type": "string"}}),
    OPENAPI_PATH: ("This description (OpenAPI 3.0)", {JSON: {"type": "object"}}),
}  # fmt: skip


def _param(path: str, name: str) -> dict[str, Any]:
    schema, doc = PARAM_DOCS[name]
    p: dict[str, Any] = {"name": name, "in": "query", "required": False, "schema": schema,
                         "description": _PARAM_NOTES.get((path, name), doc)}  # fmt: skip
    if schema.get("type") == "array":
        p |= {"style": "form", "explode": True}
    return p


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}  # fmt: skip


def _responses(path: str, ok: tuple[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": ok[0],
                                   "content": {t: {"schema": s} for t, s in ok[1].items()}}}
    if path == "/v1/stacks":
        out["200"]["description"] += (
            "; a JSON answer longer than one chunk (256 KiB) is written as it is rendered: "
            "chunked transfer coding (HTTP/1.1) or until the connection closes (HTTP/1.0), "
            "without Content-Length")
        out["200"]["headers"] = {
            "x-unwindd-truncated": {"description": "folded: stacks were left out (limit)",
                                    "schema": {"type": "string", "enum": ["true", "false"]}},
            **{h: {"description": d, "schema": {"type": "string"}}
               for h, d in _WINDOW_HEADERS.items()}}  # fmt: skip
    if path == "/v1/stream":
        out["200"]["headers"] = {"x-unwindd-clock-offset-ns": {
            "description": "CLOCK_REALTIME minus CLOCK_MONOTONIC: a sample's time plus this is "
                           "its wall-clock time", "schema": {"type": "string"}}}  # fmt: skip
        out["429"] = _error("too many stream clients ([api] max_stream_clients)")
    out["400"] = _error("a parameter the endpoint does not take, or a bad value; names it")
    out["405"] = _error("not GET")
    out["503"] = _error("too many connections ([api] max_connections)")
    return out


def _socket_paths() -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path in sorted(PARAMS):
        summary = _OK[path][0]
        params = [_param(path, n) for n in sorted(PARAMS[path])]
        paths[path] = {"get": {"summary": summary, "operationId": _op_id(path),
                               "tags": ["socket"], "parameters": params,
                               "responses": _responses(path, _OK[path])}}  # fmt: skip
    return paths


def _tcp_paths() -> dict[str, Any]:
    pull = [{"url": "http://{listen}", "description": "[export] pprof_listen (off by default)",
             "variables": {"listen": {"default": "127.0.0.1:6060"}}}]
    metrics = [{"url": "http://{listen}", "description": "[metrics] listen",
                "variables": {"listen": {"default": "127.0.0.1:9464"}}}]
    profile_ok = ("The CPU profile of the next `seconds` (gzipped pprof)",
                  {"application/octet-stream": {"type": "string", "format": "binary"}})
    profile = _responses(PROFILE, profile_ok)
    profile["401"] = _error("no or a wrong bearer token ([export] pprof_token)")
    profile["429"] = _error("more than [export] pprof_max_concurrent profiles in progress")
    profile["503"] = _error("too many connections, or the daemon is stopping")
    index = _responses(INDEX, ("What is served", {"text/plain": {"type": "string"}}))
    return {
        INDEX: {"servers": pull, "get": {
            "summary": "The pull export's index", "operationId": "pprofIndex",
            "tags": ["pprof-pull"], "parameters": [], "responses": index}},
        PROFILE: {"servers": pull, "get": {
            "summary": "Go net/http/pprof's CPU profile endpoint", "operationId": "pprofProfile",
            "tags": ["pprof-pull"], "security": [{}, {"bearer": []}],
            "parameters": [_param(PROFILE, n) for n in sorted(pull_params())],
            "responses": profile}},
        "/metrics": {"servers": metrics, "get": {
            "summary": "Prometheus metrics (text exposition format)", "operationId": "metrics",
            "tags": ["metrics"], "parameters": [],
            "responses": {"200": {"description": "the metrics",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          "405": _error("not GET")}}},
    }  # fmt: skip


def _op_id(path: str) -> str:
    if path == "/":
        return "index"
    if path == OPENAPI_PATH:
        return "openapi"
    return path.removeprefix("/v1/")


def spec() -> dict[str, Any]:
    """The OpenAPI 3.0 document (a fresh dict)."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "unwindd", "version": __version__,
                 "description": "The query API of the unwindd profiling daemon, on its Unix "
                                "socket (GET only; a peer that is not root sees only its own "
                                "processes). Time filters: " + ", ".join(FILTER_PARAMS[:4]) +
                                "; the window an answer covers is in its `window` (JSON) or "
                                "x-unwindd-window-* headers."},
        "servers": [{"url": "http://localhost",
                     "description": "the Unix socket ([api] socket, default "
                                    "/run/unwindd/unwindd.sock): e.g. curl --unix-socket"}],
        "tags": [{"name": "socket", "description": "on the Unix socket"},
                 {"name": "pprof-pull", "description": "on [export] pprof_listen (TCP)"},
                 {"name": "metrics", "description": "on [metrics] listen (TCP)"}],
        "paths": _socket_paths() | _tcp_paths(),
        "components": {
            "schemas": {"Error": ERROR, "Window": WINDOW, "Frame": FRAME, "Stacks": STACKS,
                        "Top": TOP, "Processes": PROCESSES, "Status": STATUS,
                        "Index": INDEX_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }  # fmt: skip


@cache
def spec_bytes() -> bytes:
    """``spec()`` as the endpoint answers it."""
    return json.dumps(spec(), separators=(",", ":")).encode() + b"\n"
