"""kvd_protocol.wire.describe and the header depth limit: what a peer sends reaches error
messages bounded, and nesting no op needs is refused as ``bad_request`` (no daemon)."""

from __future__ import annotations

import pytest

from kvd_protocol import wire as P


def _deep(depth: int):
    value = None
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("value", [_deep(5000), "x" * 10**6, b"\0" * 10**6, list(range(65536)),
                                   {str(i): _deep(3000) for i in range(64)}, 2**4000,
                                   "\U0001f600\n" * 1000, object()],
                         ids=lambda v: type(v).__name__)
def test_describe_is_bounded(value):
    assert len(P.describe(value)) < 1000


def test_describe_shows_scalars_and_short_values():
    assert P.describe(7) == "7" and P.describe(None) == "None" and P.describe(True) == "True"
    assert P.describe("nope") == "'nope'"
    assert P.describe("a\nb") == "'a\\nb'"  # one log line, whatever the peer sent
    assert P.describe([1, 3]) == "[1, 3]"
    assert P.describe([[1]]) == "a list of 1 item"
    assert P.describe({"k": 1, "j": 2}) == "a map of 2 entries"
    assert P.describe("y" * 100).endswith("... (100 characters)")


HELLO = {"v": 2, "id": 9, "op": "hello", "client": "c", "pid": 1, "versions": [2]}


@pytest.mark.parametrize("where", ["op", "v", "versions", "client"])
def test_nesting_beyond_the_limit_is_a_bad_request(where):
    header = {**HELLO, where: _deep(P.MAX_DEPTH)}  # the header map is one level more
    with pytest.raises(P.ProtocolError) as err:
        P.parse_request([P.pack(header)], P.OPS)
    assert (err.value.code, err.value.req_id) == ("bad_request", 9)


def test_nesting_up_to_the_limit_is_read():
    header = {**HELLO, "versions": [2, _deep(P.MAX_DEPTH - 2)]}
    assert P.parse_request([P.pack(header)], P.OPS).fields["versions"][0] == 2
