"""A bounded run of benchmarks/fuzz.py: a few hundred malformed and hostile inputs through
the Python API and gRPC beside well-formed requests. Every case ends as the contract says
(refused with the right status, or finished cleanly), the well-formed requests get their
exact tokens, every page returns and the server still serves."""

import pytest

from benchmarks.fuzz import HTTP_KINDS, KINDS, fuzz, make_http_server, make_server, table_rows
from serving.grpc_service import GrpcServer

MAX_MESSAGE_BYTES = 1 << 16


@pytest.fixture(scope="module")
def endpoint():
    with make_server() as server, GrpcServer(server, port=0, max_message_bytes=MAX_MESSAGE_BYTES,
                                             max_concurrent_rpcs=16) as grpc_server, \
            make_http_server(server) as http:
        yield server, grpc_server, http


@pytest.mark.slow
def test_fuzzed_inputs_never_hurt_the_server(endpoint):
    server, grpc_server, http = endpoint
    report = fuzz(server, grpc_server.address, cases=320, seed=1, workers=3, good_clients=3,
                  max_message_bytes=MAX_MESSAGE_BYTES, http=(http.host, http.port))
    assert [f"{o.kind} via {o.via}: {o.code} {o.unexpected}" for o in report.unexpected] == []
    assert report.good_wrong == [] and report.good_completed > 0
    assert report.good_lost == [] and report.good_hung == 0
    assert report.pages_free_end == report.pages_free_start == server.num_total_pages
    assert report.requests_left == 0 and report.healthy_after
    rows = {row["kind"]: row for row in table_rows(report)}
    assert set(rows) == set(KINDS) | set(HTTP_KINDS) | {"TOTAL"}
    total = rows["TOTAL"]
    assert total["cases"] == 320 and total["python"] > 100 and total["grpc"] > 100
    assert total["http"] >= 30
    # Deep nesting, bad priorities, slow bodies and half-open connections were all met.
    assert rows["http_body"]["INVALID_ARGUMENT"] > 0
    assert rows["http_socket"]["DEADLINE_EXCEEDED"] > 0 and rows["http_socket"]["CANCELLED"] > 0
    # Both refusal kinds and both early ends were exercised, not only clean runs.
    for code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "CANCELLED"):
        assert total[code] > 0, code
