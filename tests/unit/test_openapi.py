"""The OpenAPI description (serve/openapi.py) against the lists the handlers check, and the
answers the live fuzz (tests/integration/test_openapi_fuzz.py) found wrong, sans-IO."""

from __future__ import annotations

import json

import schemathesis
from test_httpapi import api_with_data, get
from unwindd.serve.api import PARAMS, Peer
from unwindd.serve.httpapi import HttpSession, Request, StreamStart
from unwindd.serve.openapi import OPENAPI_PATH, PARAM_DOCS, spec, spec_bytes
from unwindd.serve.pprofpull import INDEX, PROFILE, pull_params


def query_params(doc: dict[str, object], path: str) -> set[str]:
    op = doc["paths"][path]["get"]  # type: ignore[index]
    assert all(p["in"] == "query" for p in op["parameters"])
    return {p["name"] for p in op["parameters"]}


def test_every_route_and_parameter_is_described() -> None:
    doc = spec()
    api, _ = api_with_data()
    assert set(api.routes) == set(PARAMS)
    for path in api.routes:
        assert query_params(doc, path) == set(PARAMS[path]), path
    assert query_params(doc, PROFILE) == set(pull_params())
    assert query_params(doc, INDEX) == set()
    assert "/metrics" in doc["paths"]
    socket_paths = {p for p, item in doc["paths"].items() if "servers" not in item}
    assert socket_paths == set(api.routes)
    # No description of a parameter nothing takes (it would be a stale one).
    used = set().union(*PARAMS.values(), pull_params())
    assert set(PARAM_DOCS) == used


def test_the_description_loads_and_every_operation_resolves() -> None:
    schema = schemathesis.openapi.from_dict(spec())
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) == len(spec()["paths"])
    # Every $ref points at a schema that exists.
    text = json.dumps(spec())
    for name in spec()["components"]["schemas"]:
        assert f'"#/components/schemas/{name}"' in text or name == "Error"


def test_served_on_the_socket_api() -> None:
    status, headers, body = get(OPENAPI_PATH)
    assert status == 200 and headers["content-type"] == "application/json"
    assert body == spec_bytes() and json.loads(body) == spec()
    assert OPENAPI_PATH in json.loads(get("/")[2])["endpoints"]


def test_error_bodies_are_the_described_error() -> None:
    api, _ = api_with_data()
    s = HttpSession()
    s.receive(b"POST /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    req = s.next_request()
    assert isinstance(req, Request)
    res = api.handle(req, Peer(0))
    assert not isinstance(res, StreamStart)
    assert res.status == 405 and dict(res.headers)["allow"] == "GET"
    assert json.loads(res.body) == {"error": "only GET", "status": 405}
    for target in ("/v1/nope", "/v1/top?bogus=1", "/v1/top?limit=x"):
        status, _, body = get(target)
        assert set(json.loads(body)) == {"error", "status"} and status == json.loads(body)["status"]


# -- what the fuzz found


def test_a_window_start_beyond_a_float_in_ns_is_everything_held() -> None:
    # since * 1e9 overflowed to inf and int(inf) raised: a 500.
    status, _, body = get("/v1/stacks?since=1e300")
    assert status == 200 and json.loads(body)["samples"] == 6
    status, _, body = get("/v1/top?since=1e300&until=1e299")
    assert status == 200 and json.loads(body)["samples"] == 0


def test_a_window_before_boot_is_an_empty_window_not_a_500() -> None:
    # The window's wall-clock time of a far negative until_ns was no date: OverflowError.
    for target in ("/v1/top?until_ns=-99999999999999999999999999",
                   "/v1/stacks?format=folded&until_ns=-99999999999999999999999999",
                   "/v1/stacks?format=pprof&until_ns=-9223372036854775808"):  # fmt: skip
        status, _, body = get(target)
        assert status == 200, (target, body)
    window = json.loads(get("/v1/top?until_ns=-9223372036854775808")[2])["window"]
    assert window["from_ns"] == window["to_ns"] == 0 and window["seconds"] == 0


def test_stream_limit_must_be_positive() -> None:
    # limit=0 or -1 opened a stream (and ended it at once) where every other limit is a 400.
    for bad in ("0", "-1"):
        status, _, body = get(f"/v1/stream?limit={bad}")
        assert status == 400 and b"limit: must be > 0" in body


def test_numbers_are_ascii_decimal_and_empty_is_absent() -> None:
    # int()/float() took "1_000", " 5" and other scripts' digits ("٣" as 3): a tid or pid no
    # client meant. An empty value stays "not given", as the description says.
    for target in ("/v1/stacks?pid=1_000", "/v1/top?tid=%D9%A3", "/v1/top?since_ns=%205",
                   "/v1/top?since=1_0", "/v1/top?until=%D9%A3"):  # fmt: skip
        status, _, body = get(target)
        assert status == 400, (target, body)
    for target in ("/v1/top?tid=&since_ns=&since=&limit=", "/v1/stacks?pid=10&since=%2B1.5e1"):
        assert get(target)[0] == 200, target
