"""A malformed `meta` request or command never reaches the log.

Unit tests of cluster/meta_requests.py and meta/codec.py `encode`, then a real one-node
cluster sent bad `meta` requests over a peer link: each is refused and nothing is committed.
"""

import asyncio

import msgpack
import pytest

from cluster_harness import Cluster, peer_host
from mooncaked.cluster import meta_requests
from mooncaked.cluster.peer_transport import PeerLink
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec
from mooncaked.meta import commands as c
from mooncaked.meta.master import ReplicateConfig

KEY = ["ns", "k"]
CONFIG = [1, [], None, False]

GOOD = {
    "put_start": [KEY, 10, CONFIG, False, 7],
    "put_end": [KEY, 7],
    "put_revoke": [KEY, 7, 100],
    "read": [[KEY, ["ns", "other"]]],
    "remove": [KEY, True],
    "remove_matching": ["ns", "^a", False],
    "set_quota": ["ns", 1 << 20, None],
    "register": [[codec.encode(c.NodeUp(2, "n2", "127.0.0.1:1", "127.0.0.1:2"))]],
    "join": [2, "127.0.0.1:9"],
    "leave": [2],
    "remove_member": [2],
    "transfer_leader": [2],
    "drain": [2],
    "set_store_settings": [10, None, None, "random"],
}

BAD = [
    ("put_start", [KEY, 10, CONFIG, False]),  # arity
    ("put_start", [["ns", 5], 10, CONFIG, False, 7]),  # key of an int
    ("put_start", [["ns"], 10, CONFIG, False, 7]),
    ("put_start", [["ns", ""], 10, CONFIG, False, 7]),
    ("put_start", [KEY, "10", CONFIG, False, 7]),
    ("put_start", [KEY, 0, CONFIG, False, 7]),
    ("put_start", [KEY, 10, [0, [], None, False], False, 7]),  # replica_num 0
    ("put_start", [KEY, 10, [1, [b"seg"], None, False], False, 7]),
    ("put_start", [KEY, 10, [1, [], 0, False], False, 7]),
    ("put_start", [KEY, 10, [1, [], None, 1], False, 7]),
    ("put_start", [KEY, 10, CONFIG, 0, 7]),
    ("put_start", [KEY, 10, CONFIG, False, -1]),
    ("put_start", [KEY, 10, CONFIG, False, 1 << 64]),
    ("put_end", [KEY, None]),
    ("put_revoke", [KEY, 7, -5]),
    ("read", [KEY]),  # a key where a list of keys belongs
    ("remove", [KEY, "yes"]),
    ("remove_matching", ["ns", "(", False]),  # not a pattern
    ("remove_matching", [None, "a", False]),
    ("set_quota", ["ns\n", 1, 1]),
    ("set_quota", ["ns", -1, None]),
    ("set_quota", ["ns", None, "10"]),
    ("register", [[b"\xc1garbage"]]),
    ("register", [["not bytes"]]),
    ("register", [[codec.encode(c.Remove(("ns", "k"), 5))]]),  # not a registration
    ("join", [0, "127.0.0.1:9"]),
    ("join", [2, 9]),
    ("leave", [True]),
    ("drain", []),
    ("set_store_settings", [0, None, None, None]),
    ("set_store_settings", [None, "5", None, None]),
    ("set_store_settings", [None, None, None, 3]),
    ("set_store_settings", [None, None, None]),
    ("put_start", "not a list"),
]


@pytest.mark.parametrize("method", sorted(GOOD))
def test_well_formed_requests_are_converted(method):
    checked = meta_requests.check(method, GOOD[method])
    assert len(checked) == len(GOOD[method])
    if method == "put_start":
        assert checked[0] == ("ns", "k")
        assert checked[2] == ReplicateConfig(1, (), None, False)
    if method == "register":
        assert type(checked[0][0]) is c.NodeUp
    if method == "remove_matching":
        assert checked[1].search("abc")


@pytest.mark.parametrize("method,params", BAD)
def test_malformed_requests_are_refused(method, params):
    with pytest.raises(MooncakedError) as refused:
        meta_requests.check(method, params)
    assert refused.value.code == ErrorCode.INVALID_PARAMS
    assert method in refused.value.message


def test_an_unknown_meta_method():
    with pytest.raises(MooncakedError) as refused:
        meta_requests.check("put_everything", [])
    assert refused.value.code == ErrorCode.UNKNOWN_METHOD


@pytest.mark.parametrize("command", [
    c.PutEnd(("ns", 5), 1, 0, 0),
    c.PutEnd(("ns", b"k"), 1, 0, 0),
    c.Remove(("ns", "k"), True),  # release_at_ms must be an int
    c.NodeUp(2, b"name", "a", "b"),
    c.NodeDown("2"),
    c.MountSegment(1, "n/0", "n", 1 << 20, 64, None),
    c.PutEnd(("ns", "k"), 1 << 70, 0, 0),
])
def test_encode_refuses_what_decode_would(command):
    with pytest.raises(ValueError):
        codec.encode(command)


def test_encode_and_decode_agree_on_good_commands():
    for command in (c.NodeUp(2, "n2", "127.0.0.1:1", "127.0.0.1:2"),
                    c.Remove(("ns", "k"), 10), c.NodeDown(3),
                    c.MountSegment(1, "n/0", "n", 1 << 20, 64, 1024)):
        assert codec.decode(codec.encode(command)) == command


def test_a_peer_cannot_commit_a_malformed_request():
    cluster = Cluster(1).start()
    try:
        sendable = []  # what a peer can send at all (msgpack has no ints past 64 bits)
        for method, params in BAD:
            try:
                msgpack.packb([method, params])
            except OverflowError:
                continue
            sendable.append((method, params))
        before = cluster.status(1)
        address = f"{peer_host(1)}:{cluster.peer_ports[1]}"

        async def send_bad_requests() -> list:
            link = PeerLink(99, "127.0.0.1:1", 1, lambda: address, 1 << 20, 5.0)
            answers = []
            try:
                for method, params in sendable:
                    try:
                        await link.call("meta", [method, params], timeout_s=10)
                        answers.append(None)
                    except MooncakedError as exc:
                        answers.append(exc.code)
            finally:
                link.close()
            return answers

        answers = asyncio.run(send_bad_requests())
        assert answers == [ErrorCode.INVALID_PARAMS] * len(sendable)
        after = cluster.status(1)
        assert after["applied"] == before["applied"]
        assert after["last_index"] == before["last_index"]
        with cluster.client(1) as client:  # the node goes on serving
            assert client.put("after", b"value") is True
            assert client.get("after") == b"value"
    finally:
        cluster.close()
