"""Namespaces isolate bytes: a client of one namespace tries every path to another's values.

Real daemons over real sockets (wire/PROTOCOL.md 5.2, "What a connection may map"). Namespace
"tenant-a" has a pool of its own (a memfd segment); "tenant-b" and others use the shared
segments, mapped by local clients only when `share_with_local_clients` is on. What a client
of tenant-b tries against tenant-a's values: socket calls on its keys, shared-memory calls
naming tenant-a's segment and offsets, tenant-a's fd tokens (stolen, replayed, from another
process, expired, after their connection closed), the segment files and the daemon's
/proc/<pid>/fd as another user, and listing. Also what must keep working: tenant-a's client
moves bytes through its mapped pool; a namespace without a pool works through the socket.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from mooncaked import config as config_module
from mooncaked.client.blocking import BlockingClient
from mooncaked.errors import ErrorCode, MooncakedError
from tests.conftest import REPO

POOL_BYTES = 1 << 20
POOLS = f"tenant-a={POOL_BYTES}"
NOBODY = 65534


def isolated(share: bool, **extra) -> dict:
    segments = {"namespace_pools": POOLS, "share_with_local_clients": share}
    overrides = {"segments": segments}
    for section, values in extra.items():
        overrides.setdefault(section, {}).update(values)
    return overrides


def connect(daemon, namespace: str, map_segments: bool = True) -> BlockingClient:
    return BlockingClient.connect(daemon.unix_address, namespace=namespace,
                                  map_segments=map_segments)


def pool_segment_id(client: BlockingClient) -> int:
    (segment,) = client.server["segments"]
    return segment["id"]


def refused(code: int, function, *args):
    with pytest.raises(MooncakedError) as info:
        function(*args)
    assert info.value.code == code, info.value
    return info.value


def redeem(fd_socket: str, token: bytes, then_eof: bool = False
           ) -> tuple[int, int | None, str]:
    """The exchange of PROTOCOL.md 5.2 done by hand: (status, fd or None, reason)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(fd_socket)
        sock.sendall(token)
        if then_eof:
            sock.shutdown(socket.SHUT_WR)
        message, fds, _, _ = socket.recv_fds(sock, 256, 1)
        while True:
            more = sock.recv(256)
            if not more:
                break
            message += more
    assert len(fds) <= 1
    return message[0], (fds[0] if fds else None), message[1:].decode()


def wait_for_connections(daemon, count: int) -> None:
    """Until the daemon counts `count` connections (besides the one asking)."""
    with BlockingClient.connect(daemon.tcp_address) as admin:
        deadline = time.monotonic() + 10
        while admin.status()["connections"] != count + 1:
            assert time.monotonic() < deadline, "the daemon did not see the close"
            time.sleep(0.02)


def as_nobody(attempt) -> dict:
    """Run `attempt()` (returns a JSON-able dict) in a forked child running as uid/gid 65534."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(reader)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = attempt()
        except BaseException as exc:  # reported to the parent, never raised in the child
            result = {"child_error": repr(exc)}
        os.write(writer, json.dumps(result).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    assert "child_error" not in result, result
    return result


def try_open(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return type(exc).__name__
    os.close(fd)
    return "opened"


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")


# -- what keeps working -------------------------------------------------------------------------

def test_a_pool_client_maps_only_its_pool_and_moves_bytes_through_it(make_daemon):
    daemon = make_daemon(**isolated(share=False))
    value = os.urandom(POOL_BYTES // 4) + b"tenant-a"
    buffer = ctypes.create_string_buffer(value, len(value))
    with connect(daemon, "tenant-a") as a:
        (segment,) = a.server["segments"]
        assert "shm_path" not in segment and len(segment["fd_token"]) == 32
        assert a.server["fd_socket"] == daemon.unix_socket + ".fd"
        assert a.server["max_reserved_bytes"] > 0
        assert set(a.segments._maps) == {segment["id"]}
        assert a.put_from("k", ctypes.addressof(buffer), len(value)) is True
        target = ctypes.create_string_buffer(len(value))
        assert a.get_into_address("k", ctypes.addressof(target), len(value)) == len(value)
        assert target.raw == value
        assert a.get("k") == value
        replicas = a.object_stat("k")["replicas"]
        assert [r["segment_id"] for r in replicas] == [segment["id"]]
        # One round trip puts: the reserved ranges lie in the pool too.
        for i in range(4):
            assert a.put(f"small{i}", os.urandom(8192)) is True
        reserved = a.call("reserve", [[4096, 2]])
        assert reserved and {r[0] for r in reserved} == {segment["id"]}
    with connect(daemon, "tenant-a") as again:  # a new connection, a new descriptor
        assert again.get("k") == value


def test_a_pool_through_a_client_pool(make_daemon):
    from mooncaked.client.pool import ClientPool
    daemon = make_daemon(**isolated(share=False))
    value = os.urandom(200_000)
    with ClientPool.connect(daemon.unix_address, namespace="tenant-a") as pool:
        assert pool.segments
        assert pool.put("k", value) is True
        assert pool.get("k") == value


def test_a_namespace_without_a_pool_uses_the_socket_when_sharing_is_off(make_daemon):
    daemon = make_daemon(**isolated(share=False))
    value = os.urandom(300_000)
    with connect(daemon, "tenant-b") as b:
        assert b.server["segments"] == [] and b.server["fd_socket"] == ""
        assert b.server["max_reserved_bytes"] == 0 and b.segments is None
        assert b.put("k", value) is True
        assert b.get("k") == value
        assert b.batch_get(["k", "missing"]) == [value, None]
        for method, params in [("put_start", ["x", 10]), ("get_replica", ["k"]),
                               ("batch_get_replica", [["k"]]), ("reserve", [[[4096, 1]]]),
                               ("put_commit", ["x", 0, 0, 4096]),
                               ("batch_put_start", [["x"], [10]])]:
            refused(ErrorCode.NOT_SUPPORTED, b.call, method, *params)


def test_shared_segments_are_offered_when_sharing_is_on(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    with connect(daemon, "tenant-b") as b:
        (segment,) = b.server["segments"]
        assert segment["shm_path"].startswith(daemon.shm_dir)
        assert len(segment["fd_token"]) == 32
        value = os.urandom(100_000)
        assert b.put("k", value) is True and b.get("k") == value
    with connect(daemon, "tenant-a") as a:  # a pool namespace is offered its pool alone
        assert [s["id"] for s in a.server["segments"]] != [segment["id"]]
        assert "shm_path" not in a.server["segments"][0]


# -- socket calls -------------------------------------------------------------------------------

def test_another_namespace_cannot_reach_keys_by_socket_calls(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    secret = os.urandom(50_000)
    with connect(daemon, "tenant-a") as a, connect(daemon, "tenant-b") as b, \
            BlockingClient.connect(daemon.tcp_address, namespace="tenant-b") as tcp_b:
        assert a.put("secret", secret) is True
        for client in (b, tcp_b):
            refused(ErrorCode.OBJECT_NOT_FOUND, client.get, "secret")
            refused(ErrorCode.OBJECT_NOT_FOUND, client.get_size, "secret")
            assert client.exists("secret") is False
            assert client.batch_get(["secret"]) == [None]
            assert client.batch_exists(["secret"]) == [False]
            assert client.batch_remove(["secret"], True) == [int(ErrorCode.OBJECT_NOT_FOUND)]
            assert client.remove_by_regex(".*", True) == 0
            assert client.remove_all(True) == 0
            assert client.objects_list() == []
            refused(ErrorCode.OBJECT_NOT_FOUND, client.object_stat, "secret")
        refused(ErrorCode.OBJECT_NOT_FOUND, b.call, "get_replica", "secret")
        assert b.call("batch_get_replica", ["secret"]) == [int(ErrorCode.OBJECT_NOT_FOUND)]
        # A key of the same name in tenant-b is another object, in the shared pool.
        assert b.put("secret", b"b's own") is True
        assert b.get("secret") == b"b's own"
        assert a.get("secret") == secret


# -- shared-memory calls naming another pool ----------------------------------------------------

def test_offsets_in_another_pool_are_refused_and_never_handed_out(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    with connect(daemon, "tenant-a") as a, connect(daemon, "tenant-b") as b:
        pool_id = pool_segment_id(a)
        shared_ids = {s["id"] for s in b.server["segments"]}
        assert pool_id not in shared_ids
        a_ranges = a.call("reserve", [[4096, 2]])
        assert {r[0] for r in a_ranges} == {pool_id}
        (seg, off, size), (seg2, off2, _) = a_ranges
        # b names a's reserved ranges and a free offset of the pool: refused alike, and
        # nothing is released or committed.
        for offset in (off, off + 4096 * 8):
            refused(ErrorCode.INVALID_WRITE, b.call, "put_commit", "stolen", seg, offset, size)
        assert b.call("batch_put_commit", ["s1", "s2"], [[seg, off, size], [seg2, off2, size]]) \
            == [[int(ErrorCode.INVALID_WRITE)] * 2, []]
        b.call("reserve", [], [[seg, off], [seg2, off2]])  # releasing a's ranges: ignored
        assert b.exists("stolen") is False and a.exists("stolen") is False
        assert a.call("put_commit", "mine", seg, off, size) == [True, []]
        # What b is told lies in the shared pool only.
        b_ranges = b.call("reserve", [[4096, 4]])
        assert b_ranges and {r[0] for r in b_ranges} <= shared_ids
        segment_id, _ = b.call("put_start", "b-key", 4096)
        assert segment_id in shared_ids
        b.call("put_revoke", "b-key")
        assert b.put("b-value", os.urandom(70_000)) is True
        assert b.call("get_replica", "b-value")[0] in shared_ids
        segment_id, _ = a.call("put_start", "a-key", 4096)
        assert segment_id == pool_id
        a.call("put_revoke", "a-key")


def test_a_connection_keeps_its_namespace_pool(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    with connect(daemon, "tenant-a", map_segments=False) as a:
        pool_id = pool_segment_id(a)
        for namespace in ("tenant-b", "tenant-a"):  # a second hello is refused, whatever it asks
            refused(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, a.call, "hello",
                    {"protocol": 1, "namespace": namespace})
    with connect(daemon, "tenant-b", map_segments=False) as b:
        ((seg, off, size),) = b.call("reserve", [[4096, 1]])
        assert seg != pool_id  # b's ranges lie in the shared pool
        refused(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, b.call, "hello",
                {"protocol": 1, "namespace": "tenant-a"})
        # A range of tenant-a's pool named by a tenant-b connection is refused.
        refused(ErrorCode.INVALID_WRITE, b.call, "put_commit", "k", pool_id, 0, 4096)
        assert b.exists("k") is False
        assert b.call("put_commit", "k", seg, off, size)[0] is True  # its own range commits
        assert b.exists("k") is True


def test_eviction_stays_inside_a_pool(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    chunk = 64 * 1024
    with connect(daemon, "tenant-a") as a, connect(daemon, "tenant-b") as b:
        b_values = {f"b{i}": os.urandom(chunk) for i in range(8)}
        for key, value in b_values.items():
            assert b.put(key, value) is True
        for i in range(4 * POOL_BYTES // chunk):  # four times the pool: a's own are evicted
            assert a.put(f"a{i}", os.urandom(chunk)) is True
        for key, value in b_values.items():
            assert b.get(key) == value
        refused(ErrorCode.NO_AVAILABLE_HANDLE, a.put, "too-big", os.urandom(2 * POOL_BYTES))
        for key, value in b_values.items():
            assert b.get(key) == value


def test_what_another_namespace_maps_holds_none_of_the_pools_bytes(make_daemon):
    """The attack of the issue: map what you are given and search it for the other's value."""
    daemon = make_daemon(**isolated(share=True))
    secret = os.urandom(64 * 1024)
    with connect(daemon, "tenant-a") as a, connect(daemon, "tenant-b") as b:
        assert a.put("secret", secret) is True
        assert b.put("own", os.urandom(64 * 1024)) is True
        assert b.segments
        for mapped in b.segments._maps.values():
            assert mapped.find(secret[:64]) == -1
        for mapped in a.segments._maps.values():  # the search does find it where it lies
            assert mapped.find(secret[:64]) != -1


# -- the file descriptors -----------------------------------------------------------------------

def test_tokens_are_single_use_and_bound_to_their_process(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    with connect(daemon, "tenant-a", map_segments=False) as a:
        fd_socket = a.server["fd_socket"]
        token = a.server["segments"][0]["fd_token"]
        status, fd, reason = redeem(fd_socket, os.urandom(32))
        assert (status, fd) == (1, None) and "token" in reason
        status, fd, reason = redeem(fd_socket, b"short", then_eof=True)
        assert (status, fd) == (1, None)
        # Another process presents a's token: refused, and the token is spent.
        child = subprocess.run(
            [sys.executable, "-c",
             "import sys; from tests.test_namespace_isolation import redeem; "
             "status, fd, reason = redeem(sys.argv[1], bytes.fromhex(sys.argv[2])); "
             "print(status, fd is None, reason)", fd_socket, token.hex()],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
            timeout=60)
        assert child.stdout.startswith("1 True"), child.stdout + child.stderr
        assert "another process" in child.stdout
        assert redeem(fd_socket, token)[0] == 1  # spent by the attempt
    with connect(daemon, "tenant-a", map_segments=False) as a:
        token = a.server["segments"][0]["fd_token"]
        status, fd, _ = redeem(a.server["fd_socket"], token)
        assert status == 0 and fd is not None
        try:
            assert os.fstat(fd).st_size == POOL_BYTES
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        finally:
            os.close(fd)
        status, fd, _ = redeem(a.server["fd_socket"], token)  # replayed
        assert (status, fd) == (1, None)


def test_tokens_die_with_their_connection_and_their_time(make_daemon):
    daemon = make_daemon(**isolated(share=True, server={"fd_token_ttl_ms": 200}))
    a = connect(daemon, "tenant-a", map_segments=False)
    fd_socket, token = a.server["fd_socket"], a.server["segments"][0]["fd_token"]
    a.close()
    wait_for_connections(daemon, 0)
    assert redeem(fd_socket, token)[:2] == (1, None)
    with connect(daemon, "tenant-a", map_segments=False) as a:
        token = a.server["segments"][0]["fd_token"]
        time.sleep(0.6)  # three times the token's life
        status, fd, _ = redeem(fd_socket, token)
        assert (status, fd) == (1, None)


def test_another_namespace_is_never_given_the_pool(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    with connect(daemon, "tenant-a", map_segments=False) as a:
        pool_id = pool_segment_id(a)
    for namespace in ("tenant-b", "default", "tenant-a-x", "tenant"):
        with connect(daemon, namespace, map_segments=False) as other:
            assert pool_id not in {s["id"] for s in other.server["segments"]}
            assert all("shm_path" in s for s in other.server["segments"])
    with BlockingClient.connect(daemon.tcp_address, namespace="tenant-a") as tcp_a:
        assert tcp_a.server["segments"] == [] and tcp_a.server["fd_socket"] == ""


# -- files and /proc, as another user -----------------------------------------------------------

def test_segment_files_are_private_to_the_daemon(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    names = os.listdir(daemon.shm_dir)
    assert len(names) == 1  # the shared segment; a namespace pool has no file
    info = os.stat(os.path.join(daemon.shm_dir, names[0]))
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()


@needs_root
def test_another_user_can_open_neither_segment_files_nor_the_daemons_fds(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    for directory in (daemon.workdir, daemon.shm_dir):  # only the files' own modes protect
        os.chmod(directory, 0o755)
    paths = [os.path.join(daemon.shm_dir, name) for name in os.listdir(daemon.shm_dir)]
    pid = daemon.process.pid
    fd_paths = [os.path.join(f"/proc/{pid}/fd", name) for name in os.listdir(f"/proc/{pid}/fd")]
    memfds = [p for p in fd_paths if os.readlink(p).startswith("/memfd:mooncaked-pool-")]
    assert memfds, "the daemon holds its pool's memfd"

    def attempt() -> dict:
        try:
            os.listdir(f"/proc/{pid}/fd")
            listing = "listed"
        except OSError as exc:
            listing = type(exc).__name__
        return {"files": [try_open(p) for p in paths],
                "fds": [try_open(p) for p in fd_paths],
                "mem": try_open(f"/proc/{pid}/mem"), "listing": listing,
                "uid": os.getuid()}

    result = as_nobody(attempt)
    assert result["uid"] == NOBODY
    assert result["files"] == ["PermissionError"] * len(paths)
    assert set(result["fds"]) == {"PermissionError"}
    assert result["mem"] == "PermissionError" and result["listing"] == "PermissionError"


@needs_root
def test_another_user_cannot_use_a_stolen_token(make_daemon):
    daemon = make_daemon(**isolated(share=True))
    os.chmod(daemon.workdir, 0o755)
    os.chmod(daemon.unix_socket + ".fd", 0o666)  # even if the socket were reachable
    with connect(daemon, "tenant-a", map_segments=False) as a:
        fd_socket, token = a.server["fd_socket"], a.server["segments"][0]["fd_token"]

        def attempt() -> dict:
            status, fd, reason = redeem(fd_socket, token)
            return {"status": status, "fd": fd, "reason": reason}

        result = as_nobody(attempt)
        assert (result["status"], result["fd"]) == (1, None)
        assert "another process" in result["reason"]


# -- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o604, 0o666, 0o601, 0o777])
def test_a_mode_for_other_users_is_refused(mode):
    with pytest.raises(config_module.ConfigError) as info:
        config_module.from_dict({"segments": {"shm_mode": mode}})
    assert "other users" in str(info.value) and f"0o{mode:o}" in str(info.value)


def test_group_mode_is_accepted():
    assert config_module.from_dict({"segments": {"shm_mode": 0o660}}).segments.shm_mode == 0o660


@pytest.mark.parametrize("text, fragment", [
    ("tenant-a", "namespace=size_bytes"),
    ("tenant-a=12x", "namespace=size_bytes"),
    ("bad name=4096", "namespace=size_bytes"),
    ("a=4096,a=8192", "named twice"),
    ("a=100", "size_bytes must be"),
])
def test_bad_namespace_pools_are_refused(text, fragment):
    with pytest.raises(config_module.ConfigError) as info:
        config_module.from_dict({"segments": {"namespace_pools": text}})
    assert "namespace_pools" in str(info.value) and fragment in str(info.value)


def test_namespace_pools_in_a_cluster_are_refused():
    with pytest.raises(config_module.ConfigError) as info:
        config_module.from_dict({"segments": {"namespace_pools": POOLS},
                                 "cluster": {"enabled": True, "node_id": 1}})
    assert "not supported with [cluster] enabled" in str(info.value)


def test_pools_parse():
    assert config_module.parse_namespace_pools(" a=4096, b.c/d:e=8192 ,") == \
        {"a": 4096, "b.c/d:e": 8192}
