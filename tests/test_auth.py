"""Authentication and roles against a real daemon (wire/PROTOCOL.md 4.1-4.2, README).

- the challenge-response: the right secret binds the principal and the client checks the
  daemon's signature; a wrong secret and an unknown principal get the same answer, and the
  connection is closed; a daemon whose signature is wrong is refused by the client; the secret
  never crosses the wire (the client's bytes are captured by a proxy);
- roles per method, checked before the handler: a read-only principal cannot put or remove; a
  write principal cannot list or stat another namespace, bind to one it has no role in, or call
  daemon-wide methods; an admin can; refused requests leave the connection usable;
- a second hello is refused and the first binding kept;
- the Unix socket maps the peer's uid (SO_PEERCRED) to a principal, on both event loops: a
  child process that takes another uid with os.setuid is let in when mapped, refused when not;
- the credentials file: refused (the daemon does not start) when group or others may read or
  write it, when another user owns it, or when an entry is malformed (the message names it);
  reloaded on SIGHUP;
- no credentials file: today's behaviour, a warning when TCP is not on loopback;
- clients take credentials from the environment; mooncakectl from a flag, the environment or
  a file, and writes the file with `auth add-principal`;
- the worked example of wire/vectors/auth.json, with the project's code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, write_config
from mooncaked import credentials as credentials_file
from mooncaked.client import auth as client_auth
from mooncaked.client import calls
from mooncaked.client.aio import Client
from mooncaked.client.blocking import BlockingClient
from mooncaked.client.pool import ClientPool
from mooncaked.daemon import auth as daemon_auth
from mooncaked.daemon import cluster_handlers, handlers
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.io import uring
from mooncaked.proto import framing, scram
from test_wire_vectors import from_json
from wire_helpers import MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, connect, read_response, \
    request_frame, same, split_frames

ITERATIONS = scram.MIN_ITERATIONS  # fast for tests; the default is far higher
PEER_UID = 41234  # a uid the credentials map to principal "peer"
STRANGER_UID = 41235  # a uid they map to no principal
SECRETS = {"writer": b"writer-secret", "reader": b"reader-secret", "admin": b"admin-secret",
           "a-admin": b"a-admin-secret"}
ROLES = {"writer": {"a": "write"}, "reader": {"a": "read"}, "admin": {"*": "admin"},
         "a-admin": {"a": "admin"}}
AUTH_VECTORS = os.path.join(REPO, "wire", "vectors", "auth.json")


def make_credentials(path: str, server_keys: dict | None = None) -> None:
    creds = credentials_file.Credentials()
    for name, secret in SECRETS.items():
        creds = credentials_file.with_principal(creds, credentials_file.new_principal(
            name, secret, ROLES[name], iterations=ITERATIONS))
    creds = credentials_file.with_principal(creds, credentials_file.new_principal(
        "peer", None, {"a": "write"}, uids=[PEER_UID]))
    for name, key in (server_keys or {}).items():
        creds.principals[name] = dataclasses.replace(creds.principals[name], server_key=key)
    credentials_file.write(path, creds)


@pytest.fixture
def credentials_path(tmp_path) -> str:
    path = str(tmp_path / "credentials.toml")
    make_credentials(path)
    return path


@pytest.fixture
def auth_daemon(make_daemon, credentials_path):
    return make_daemon(auth={"credentials_file": credentials_path})


def as_(daemon, name: str, namespace: str = "a", address: str | None = None):
    return BlockingClient.connect(address or daemon.tcp_address, namespace=namespace,
                                  principal=name, secret=SECRETS[name], map_segments=False)


def expect(code: int, function, *args):
    with pytest.raises(MooncakedError) as info:
        function(*args)
    assert info.value.code == code, info.value
    return info.value


def raw_call(sock, msgid: int, method: str, params: list, payload: bytes = b""):
    sock.sendall(request_frame(msgid, method, params, payload))
    got_msgid, error, result, _ = read_response(sock)
    assert got_msgid == msgid
    return error, result


def read_until_closed(sock) -> bytes:
    data = bytearray()
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return bytes(data)
        data += chunk


def raw_hello_with_proof(daemon, principal: str, secret: bytes, namespace: str = "a"):
    """auth_start + hello by hand; the socket and hello's (error, result)."""
    sock = connect(daemon, "tcp", 10)
    client_nonce = os.urandom(32)
    error, challenge = raw_call(sock, 1, "auth_start", [principal, client_nonce])
    assert error is None
    salted = scram.salted_secret(secret, challenge["salt"], challenge["iterations"])
    message = scram.auth_message(principal, namespace, client_nonce, challenge["server_nonce"],
                                 challenge["salt"], challenge["iterations"])
    proof = scram.client_proof(scram.client_key(salted), message)
    sock.sendall(request_frame(2, "hello", [{"protocol": 1, "namespace": namespace,
                                             "principal": principal, "proof": proof}]))
    return sock, challenge


# -- the challenge-response ---------------------------------------------------------------------

def test_right_secret_binds_the_principal(auth_daemon):
    with as_(auth_daemon, "writer") as client:
        assert client.server["principal"] == "writer"
        assert client.server["namespace"] == "a"
        assert type(client.server["server_signature"]) is bytes
        assert client.put("k", b"value") is True
        assert client.get("k") == b"value"


def test_wrong_secret_and_unknown_principal_get_the_same_answer_and_are_closed(auth_daemon):
    answers = []
    for principal, secret in (("writer", b"not-the-secret"), ("nobody", b"writer-secret")):
        sock, challenge = raw_hello_with_proof(auth_daemon, principal, secret)
        assert type(challenge["salt"]) is bytes and len(challenge["salt"]) == 16
        assert challenge["iterations"] == ITERATIONS  # an unknown name looks like a real one
        frames = split_frames(read_until_closed(sock))  # the daemon closes after its answer
        sock.close()
        assert len(frames) == 1, frames
        header, _ = frames[0]
        assert header[0] == framing.RESPONSE and header[1] == 2 and header[3] is None
        answers.append(header[2])
    assert answers[0] == answers[1] == [ErrorCode.AUTH_FAILED, "authentication failed"]
    for principal, secret in (("writer", b"x"), ("nobody", b"y")):
        error = expect(ErrorCode.AUTH_FAILED, functools.partial(
            BlockingClient.connect, principal=principal, secret=secret),
            auth_daemon.tcp_address, "a", "", 10, False)
        assert error.message == "authentication failed"


def test_unknown_principal_gets_the_same_salt_each_time(auth_daemon):
    salts = []
    for _ in range(2):
        sock = connect(auth_daemon, "tcp", 10)
        error, challenge = raw_call(sock, 1, "auth_start", ["nobody", os.urandom(16)])
        sock.close()
        assert error is None
        salts.append(challenge["salt"])
    assert salts[0] == salts[1]


def test_hello_without_its_auth_start_or_credentials_is_refused(auth_daemon):
    sock = connect(auth_daemon, "tcp", 10)
    sock.sendall(request_frame(1, "hello", [{"protocol": 1, "namespace": "a",
                                             "principal": "writer", "proof": bytes(32)}]))
    [(header, _)] = split_frames(read_until_closed(sock))
    assert header[2] == [ErrorCode.AUTH_FAILED, "authentication failed"]
    sock.close()
    # Over TCP, a hello without credentials: refused.
    error = expect(ErrorCode.AUTH_FAILED, BlockingClient.connect, auth_daemon.tcp_address, "a")
    assert "authentication required" in error.message
    # And nothing else may run before hello.
    sock = connect(auth_daemon, "tcp", 10)
    error, _ = raw_call(sock, 1, "status", [])
    assert error[0] == ErrorCode.HANDSHAKE_REQUIRED
    sock.close()


def test_client_refuses_a_daemon_whose_signature_is_wrong(make_daemon, tmp_path):
    # The daemon's file has writer's StoredKey (so it accepts the proof) but not its ServerKey:
    # it cannot prove itself, and the client must not go on.
    path = str(tmp_path / "credentials.toml")
    make_credentials(path, server_keys={"writer": bytes(32)})
    daemon = make_daemon(auth={"credentials_file": path})
    error = expect(ErrorCode.AUTH_FAILED, as_, daemon, "writer")
    assert "server_signature" in error.message

    async def run():
        await Client.connect(daemon.tcp_address, namespace="a", principal="writer",
                             secret=SECRETS["writer"])
    with pytest.raises(MooncakedError) as info:
        asyncio.run(run())
    assert info.value.code == ErrorCode.AUTH_FAILED


class CapturingProxy:
    """Forwards one TCP connection to the daemon and keeps every byte the client sent."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.client_bytes = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))

        def pump(source, sink, record) -> None:
            while True:
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                if record:
                    self.client_bytes += data
                sink.sendall(data)
        back = threading.Thread(target=pump, args=(upstream, client, False), daemon=True)
        back.start()
        try:
            pump(client, upstream, True)
        except OSError:
            pass
        back.join(10)
        client.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


def test_the_secret_never_crosses_the_wire(auth_daemon, credentials_path):
    proxy = CapturingProxy(auth_daemon.tcp_port)
    secret = SECRETS["writer"]
    with BlockingClient.connect(f"127.0.0.1:{proxy.port}", namespace="a", principal="writer",
                                secret=secret) as client:
        assert client.put("through-proxy", b"v") is True
    proxy.close()
    sent = bytes(proxy.client_bytes)
    assert b"auth_start" in sent and b"through-proxy" in sent  # the capture is complete
    assert secret not in sent
    principal = credentials_file.load(credentials_path).principals["writer"]
    salted = scram.salted_secret(secret, principal.salt, principal.iterations)
    for derived in (salted, scram.client_key(salted), principal.stored_key,
                    principal.server_key):
        assert derived not in sent


# -- roles --------------------------------------------------------------------------------------

def test_read_only_principal_cannot_put_or_remove(auth_daemon):
    with as_(auth_daemon, "writer") as writer:
        writer.put("shared", b"bytes")
    with as_(auth_daemon, "reader") as reader:
        assert reader.get("shared") == b"bytes"
        assert reader.exists("shared") and reader.get_size("shared") == 5
        assert reader.batch_get(["shared"]) == [b"bytes"]
        for call in ((reader.put, "new", b"x"), (reader.upsert, "shared", b"y"),
                     (reader.remove, "shared"), (reader.remove_all,),
                     (reader.remove_by_regex, ".*"), (reader.batch_remove, ["shared"]),
                     (reader.batch_put, ["new"], [b"x"])):
            error = expect(ErrorCode.PERMISSION_DENIED, *call)
            assert "needs role write on namespace 'a'" in error.message
        assert reader.call("ping") == "pong"  # the connection stays open
        assert reader.get("shared") == b"bytes"  # and nothing changed
        assert not reader.exists("new")
        assert [o["key"] for o in reader.objects_list()] == ["shared"]  # its own namespace


def test_refused_request_with_a_payload_stores_nothing(auth_daemon):
    sock, _ = raw_hello_with_proof(auth_daemon, "reader", SECRETS["reader"])
    _, error, result, _ = read_response(sock)
    assert error is None and result["principal"] == "reader"
    sock.sendall(request_frame(3, "put", ["smuggled", None], b"x" * 100_000)
                 + request_frame(4, "ping", []))
    assert read_response(sock)[1][0] == ErrorCode.PERMISSION_DENIED
    assert read_response(sock)[:3] == (4, None, "pong")  # the payload was dropped, not parsed
    sock.close()
    with as_(auth_daemon, "writer") as writer:
        assert not writer.exists("smuggled")


def test_write_principal_cannot_reach_other_namespaces_or_administer(auth_daemon):
    with as_(auth_daemon, "admin", namespace="b") as other:
        other.put("secret-of-b", b"b-bytes")
    with as_(auth_daemon, "writer") as writer:
        writer.put("mine", b"a-bytes")
        assert [o["key"] for o in writer.objects_list()] == ["mine"]
        assert [o["key"] for o in writer.objects_list(namespace="a")] == ["mine"]
        assert writer.object_stat("mine")["namespace"] == "a"
        error = expect(ErrorCode.PERMISSION_DENIED, writer.objects_list, "", None, "*")
        assert "admin on every namespace" in error.message
        error = expect(ErrorCode.PERMISSION_DENIED, writer.objects_list, "", None, "b")
        assert "admin on namespace 'b'" in error.message
        expect(ErrorCode.PERMISSION_DENIED, writer.object_stat, "secret-of-b", "b")
        for method in ("status", "segments", "config_show", "cluster_status"):
            error = expect(ErrorCode.PERMISSION_DENIED, writer.call, method)
            assert error.message.startswith(f"{method} needs role admin on every namespace")
        assert writer.remove_all() == 1  # only its own namespace
    # Binding to a namespace it has no role in is refused.
    error = expect(ErrorCode.PERMISSION_DENIED, as_, auth_daemon, "writer", "b")
    assert "no role on namespace 'b'" in error.message
    with as_(auth_daemon, "admin", namespace="b") as other:
        assert other.get("secret-of-b") == b"b-bytes"


def test_admin_lists_and_stats_across_namespaces(auth_daemon):
    with as_(auth_daemon, "writer") as writer:
        writer.put("in-a", b"1")
    with as_(auth_daemon, "admin", namespace="b") as admin:
        admin.put("in-b", b"2")
        assert sorted((o["namespace"], o["key"]) for o in admin.objects_list(namespace="*")) \
            == [("a", "in-a"), ("b", "in-b")]
        assert admin.object_stat("in-a", "a")["key"] == "in-a"
        assert admin.status()["objects"] == 2
        assert admin.call("cluster_status") is None
    with as_(auth_daemon, "a-admin", namespace="a") as a_admin:
        assert [o["key"] for o in a_admin.objects_list(namespace="a")] == ["in-a"]
        expect(ErrorCode.PERMISSION_DENIED, a_admin.objects_list, "", None, "b")
        expect(ErrorCode.PERMISSION_DENIED, a_admin.objects_list, "", None, "*")
        expect(ErrorCode.PERMISSION_DENIED, a_admin.call, "status")


def test_every_method_has_a_role():
    for table in (handlers.HANDLERS, cluster_handlers.HANDLERS):
        assert set(table) <= set(daemon_auth.METHOD_ROLES), \
            sorted(set(table) - set(daemon_auth.METHOD_ROLES))


# -- one binding per connection -----------------------------------------------------------------

@pytest.mark.parametrize("with_auth", [True, False], ids=["auth", "no-auth"])
def test_second_hello_is_refused_and_the_first_binding_kept(make_daemon, credentials_path,
                                                           with_auth):
    daemon = make_daemon(auth={"credentials_file": credentials_path if with_auth else ""})
    client = as_(daemon, "admin", "a") if with_auth else \
        BlockingClient.connect(daemon.tcp_address, namespace="a", map_segments=False)
    with client:
        client.put("in-a", b"1")
        error = expect(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, client._run, calls.hello("b", ""))
        assert "namespace 'a'" in error.message
        expect(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, client._run,
               calls.Call("auth_start", ["admin", os.urandom(16)]))
        assert client.get("in-a") == b"1"  # still namespace a
        client.put("also-in-a", b"2")
        assert sorted(o["key"] for o in client.objects_list()) == ["also-in-a", "in-a"]


# -- the Unix socket: SO_PEERCRED ---------------------------------------------------------------

def _as_uid(uid: int, address: str) -> dict:
    """In a forked child running as `uid`: connect without credentials, try a put and status."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        report = {}
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with BlockingClient.connect(address, namespace="a", map_segments=False,
                                        timeout_s=10) as client:
                report["principal"] = client.server["principal"]
                report["put"] = client.put(f"from-{uid}", b"peer bytes")
                try:
                    client.status()
                    report["status"] = "ok"
                except MooncakedError as exc:
                    report["status"] = exc.code
        except MooncakedError as exc:
            report["error"] = [exc.code, exc.message]
        except BaseException as exc:
            report["error"] = repr(exc)
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    data = b""
    while chunk := os.read(read_end, 65536):
        data += chunk
    os.close(read_end)
    os.waitpid(pid, 0)
    return json.loads(data)


LOOPS = ["asyncio", pytest.param("uring", marks=pytest.mark.skipif(
    not uring.usable()[0], reason=f"io_uring unusable here: {uring.usable()[1]}"))]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
@pytest.mark.parametrize("loop", LOOPS)
def test_unix_peer_uid_maps_to_a_principal(make_daemon, credentials_path, loop, monkeypatch):
    monkeypatch.delenv("MOONCAKED_LOOP", raising=False)
    daemon = make_daemon(auth={"credentials_file": credentials_path}, server={"loop": loop})
    # Let other uids reach the socket (the test's directory is root's, mode 700).
    os.chmod(daemon.workdir, 0o755)
    os.chmod(daemon.unix_socket, 0o666)
    mapped = _as_uid(PEER_UID, daemon.unix_address)
    assert mapped == {"principal": "peer", "put": True, "status": ErrorCode.PERMISSION_DENIED}
    refused = _as_uid(STRANGER_UID, daemon.unix_address)
    assert refused["error"][0] == ErrorCode.AUTH_FAILED, refused
    assert f"uid {STRANGER_UID}" in refused["error"][1]
    with as_(daemon, "admin", address=daemon.unix_address) as admin:  # a secret works there too
        assert admin.get(f"from-{PEER_UID}") == b"peer bytes"
        assert admin.status()["loop"] == loop


# -- the credentials file -----------------------------------------------------------------------

def check_config(tmp_path, credentials: str) -> subprocess.CompletedProcess:
    config = str(tmp_path / "mooncaked.toml")
    write_config(config, {"auth": {"credentials_file": credentials}})
    return subprocess.run([sys.executable, "-m", "mooncaked", "--config", config,
                           "--check-config"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=60)


def test_credentials_file_must_be_private_and_owned_by_the_daemon_user(tmp_path,
                                                                       credentials_path):
    assert check_config(tmp_path, credentials_path).returncode == 0
    for mode in (0o640, 0o604, 0o620, 0o602):
        os.chmod(credentials_path, mode)
        done = check_config(tmp_path, credentials_path)
        assert done.returncode == 2, (oct(mode), done.stderr)
        assert f"mode 0o{mode:o} lets group or others read or write it" in done.stderr
    os.chmod(credentials_path, 0o600)
    if os.geteuid() == 0:
        os.chown(credentials_path, PEER_UID, -1)
        done = check_config(tmp_path, credentials_path)
        assert done.returncode == 2 and f"owned by uid {PEER_UID}" in done.stderr
        os.chown(credentials_path, 0, -1)
    done = check_config(tmp_path, str(tmp_path / "missing.toml"))
    assert done.returncode == 2 and "cannot open" in done.stderr


MALFORMED = [
    ('[principals.alice]\nroles = { "a" = "write" }\n', "principal 'alice': needs a verifier"),
    ('[principals.alice]\nroles = { "a" = "owner" }\nuids = [5]\n',
     "principal 'alice': roles: 'a' = 'owner' is not one of read, write, admin"),
    ('[principals.alice]\nsalt = "00"\niterations = 4096\nstored_key = "00"\n'
     'server_key = "00"\nroles = { "a" = "read" }\n',
     "principal 'alice': salt must be a hex string of 16-64 bytes"),
    ('[principals.alice]\nroles = { "a" = "read" }\nuids = [5]\n'
     '[principals.bob]\nroles = { "a" = "read" }\nuids = [5]\n',
     "principal 'bob': uid 5 is already mapped to principal 'alice'"),
    ('[principals.alice]\nroles = { "a" = "read" }\nuids = [5]\npassword = "x"\n',
     "principal 'alice': unknown keys password"),
    ('[principals."al ice"]\nroles = { "a" = "read" }\nuids = [5]\n', "principal 'al ice'"),
    ('[principals.alice]\nroles = { "a\\n" = "read" }\nuids = [5]\n',
     "principal 'alice': roles: 'a\\n' is neither"),
    ('[principals.alice\nroles = 1\n', "not valid TOML"),
]


@pytest.mark.parametrize("text,message", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_credentials_are_refused_naming_the_entry(tmp_path, text, message):
    path = tmp_path / "credentials.toml"
    path.write_text(text)
    path.chmod(0o600)
    done = check_config(tmp_path, str(path))
    assert done.returncode == 2, done.stdout
    assert message in done.stderr, done.stderr
    if "TOML" in message:
        assert "line 1" in done.stderr


def test_daemon_refuses_to_start_with_a_readable_credentials_file(make_daemon,
                                                                  credentials_path):
    os.chmod(credentials_path, 0o644)
    with pytest.raises(RuntimeError) as info:
        make_daemon(auth={"credentials_file": credentials_path})
    assert "exited with 2" in str(info.value)
    assert "lets group or others read or write it; chmod 600 it" in str(info.value)


def test_sighup_reloads_the_credentials_for_open_connections(auth_daemon, credentials_path):
    with as_(auth_daemon, "writer") as writer:
        writer.put("before", b"1")
        creds = credentials_file.load(credentials_path)
        reduced = credentials_file.with_principal(creds, dataclasses.replace(
            creds.principals["writer"], roles={"a": "read"}))
        credentials_file.write(credentials_path, reduced)
        os.kill(auth_daemon.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "credentials reloaded" not in auth_daemon.log():
            assert time.monotonic() < deadline, auth_daemon.log()
            time.sleep(0.05)
        expect(ErrorCode.PERMISSION_DENIED, writer.put, "after", b"2")
        assert writer.get("before") == b"1"
    # A bad file is not taken: the previous credentials stay.
    with open(credentials_path, "a") as f:
        f.write("[principals.broken]\n")
    os.kill(auth_daemon.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "credentials not reloaded" not in auth_daemon.log():
        assert time.monotonic() < deadline, auth_daemon.log()
        time.sleep(0.05)
    with as_(auth_daemon, "admin") as admin:
        assert admin.get("before") == b"1"


# -- no credentials file ------------------------------------------------------------------------

def test_without_credentials_everything_is_open_as_before(make_daemon):
    daemon = make_daemon()
    with BlockingClient.connect(daemon.tcp_address, namespace="a") as client:
        assert client.server["principal"] is None
        client.put("k", b"v")
        assert client.status()["objects"] == 1
        assert client.objects_list(namespace="*")[0]["key"] == "k"
    sock = connect(daemon, "tcp", 10)
    error, _ = raw_call(sock, 1, "auth_start", ["x", os.urandom(16)])
    assert error[0] == ErrorCode.NOT_SUPPORTED
    sock.close()
    # A client that has credentials does not accept a daemon that cannot prove itself.
    error = expect(ErrorCode.AUTH_FAILED, functools.partial(
        BlockingClient.connect, principal="writer", secret="secret"), daemon.tcp_address, "a",
        "", 10, False)
    assert "does not authenticate" in error.message
    assert "authentication is off" not in daemon.log()  # loopback: no warning


def test_without_credentials_on_a_public_address_the_daemon_warns(make_daemon):
    daemon = make_daemon(server={"tcp_host": "0.0.0.0"})
    assert "authentication is off ([auth] credentials_file is empty) and the TCP listener " \
           "is on 0.0.0.0, not loopback" in daemon.log()


# -- clients and mooncakectl --------------------------------------------------------------------

def test_clients_take_credentials_from_the_environment(auth_daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKED_PRINCIPAL", "writer")
    monkeypatch.setenv("MOONCAKED_SECRET", SECRETS["writer"].decode())
    with ClientPool.connect(auth_daemon.tcp_address, namespace="a") as pool:
        assert pool.server["principal"] == "writer"
        assert pool.put("pooled", b"1") is True

    async def run():
        async with await Client.connect(auth_daemon.tcp_address, namespace="a") as client:
            assert client.server["principal"] == "writer"
            return await client.get("pooled")
    assert asyncio.run(run()) == b"1"

    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRETS["writer"] + b"\n")
    monkeypatch.delenv("MOONCAKED_SECRET")
    monkeypatch.setenv("MOONCAKED_SECRET_FILE", str(secret_file))
    with BlockingClient.connect(auth_daemon.tcp_address, namespace="a") as client:
        assert client.server["principal"] == "writer"
        assert client.get("pooled") == b"1"
    # The Mooncake facade, unchanged, authenticates through the environment too (its
    # connection is bound to namespace "default": admin's role on "*" covers it).
    from mooncaked.mooncake_store import MooncakeDistributedStore
    monkeypatch.setenv("MOONCAKED_PRINCIPAL", "admin")
    monkeypatch.setenv("MOONCAKED_SECRET", SECRETS["admin"].decode())
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
                       auth_daemon.tcp_address) == 0
    assert store.put("facade", b"bytes") == 0 and store.get("facade") == b"bytes"
    store.close()
    monkeypatch.delenv("MOONCAKED_SECRET")
    monkeypatch.setenv("MOONCAKED_PRINCIPAL", "writer")
    monkeypatch.delenv("MOONCAKED_SECRET_FILE")
    with pytest.raises(ValueError, match="needs a secret"):
        BlockingClient.connect(auth_daemon.tcp_address, namespace="a")


def ctl(*args, env=None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}
    environment.update(PYTHONPATH=REPO, **(env or {}))
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", *args], capture_output=True,
                          text=True, cwd=REPO, env=environment, timeout=60)


def test_mooncakectl_takes_credentials_from_a_flag_the_environment_or_a_file(auth_daemon,
                                                                             tmp_path):
    secret_file = tmp_path / "admin.secret"
    secret_file.write_bytes(SECRETS["admin"] + b"\n")
    address = ["-a", auth_daemon.tcp_address, "-o", "json"]
    by_flag = ctl(*address, "--principal", "admin", "--secret-file", str(secret_file), "status")
    assert by_flag.returncode == 0, by_flag.stderr
    assert json.loads(by_flag.stdout)["node_name"] == "test-node"
    by_env = ctl(*address, "status", env={"MOONCAKED_PRINCIPAL": "admin",
                                          "MOONCAKED_SECRET": SECRETS["admin"].decode()})
    assert by_env.returncode == 0, by_env.stderr
    by_file = ctl(*address, "status", env={"MOONCAKED_PRINCIPAL": "admin",
                                           "MOONCAKED_SECRET_FILE": str(secret_file)})
    assert by_file.returncode == 0, by_file.stderr
    none = ctl(*address, "status")
    assert none.returncode == 1 and "AUTH_FAILED (-3020)" in none.stderr
    reader_secret = tmp_path / "reader.secret"
    reader_secret.write_bytes(SECRETS["reader"])
    denied = ctl(*address, "--principal", "reader", "--secret-file", str(reader_secret),
                 "status")
    assert denied.returncode == 1 and "PERMISSION_DENIED (-3021)" in denied.stderr
    reader = ["--principal", "reader", "--secret-file", str(reader_secret)]
    listed = ctl(*address, *reader, "objects", "ls", "--namespace", "a")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    everything = ctl(*address, *reader, "-n", "a", "objects", "ls", "--all-namespaces")
    assert everything.returncode == 1 and "admin on every namespace" in everything.stderr
    wrong = ctl(*address, "--principal", "admin", "--secret-file", str(reader_secret), "status")
    assert wrong.returncode == 1 and "authentication failed" in wrong.stderr
    half = ctl(*address, "--secret-file", str(reader_secret), "status")
    assert half.returncode == 1 and "without a principal" in half.stderr


def test_mooncakectl_add_principal_writes_a_file_the_daemon_loads(make_daemon, tmp_path):
    path = str(tmp_path / "creds" / "credentials.toml")
    os.makedirs(os.path.dirname(path))
    made = ctl("auth", "add-principal", "vllm", "--role", "llama=write", "--role", "*=read",
               "--iterations", str(ITERATIONS), "--file", path)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert len(secret) >= 32 and secret not in open(path).read()
    assert os.stat(path).st_mode & 0o777 == 0o600
    again = ctl("auth", "add-principal", "vllm", "--role", "llama=read", "--file", path)
    assert again.returncode == 1 and "--replace" in again.stderr
    secret_file = tmp_path / "ops.secret"
    secret_file.write_text("ops secret\n")
    made = ctl("auth", "add-principal", "ops", "--role", "*=admin", "--secret-file",
               str(secret_file), "--iterations", str(ITERATIONS), "--uid", str(PEER_UID),
               "--file", path)
    assert made.returncode == 0 and made.stdout == "", made.stderr
    bad = ctl("auth", "add-principal", "x", "--role", "llama=boss", "--no-secret", "--uid", "7",
              "--file", path)
    assert bad.returncode == 1 and "'llama' = 'boss' is not one of" in bad.stderr
    daemon = make_daemon(auth={"credentials_file": path})
    with BlockingClient.connect(daemon.tcp_address, namespace="llama", principal="vllm",
                                secret=secret) as client:
        assert client.put("k", b"v") is True
    with BlockingClient.connect(daemon.tcp_address, namespace="llama", principal="ops",
                                secret="ops secret") as client:
        assert client.status()["objects"] == 1
    assert ctl("auth", "remove-principal", "ops", "--file", path).returncode == 0
    assert "ops" not in credentials_file.load(path).principals
    hashed = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "auth", "hash-secret",
                             "--iterations", "5000"], input=b"abc\n", capture_output=True,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    lines = dict(line.split(" = ") for line in hashed.stdout.decode().splitlines())
    salt = bytes.fromhex(json.loads(lines["salt"]))
    stored, server = scram.verifier(b"abc", salt, 5000)
    assert json.loads(lines["stored_key"]) == stored.hex()
    assert json.loads(lines["server_key"]) == server.hex() and lines["iterations"] == "5000"


# -- the worked example -------------------------------------------------------------------------

def load_auth_vectors() -> dict:
    with open(AUTH_VECTORS, encoding="utf-8") as f:
        return json.load(f)


def test_the_worked_example_of_the_spec():
    example = load_auth_vectors()["scram"]
    given = example["inputs"]
    secret, salt = bytes.fromhex(given["secret_hex"]), bytes.fromhex(given["salt_hex"])
    client_nonce = bytes.fromhex(given["client_nonce_hex"])
    server_nonce = bytes.fromhex(given["server_nonce_hex"])
    salted = scram.salted_secret(secret, salt, given["iterations"])
    assert salted.hex() == example["salted_secret_hex"]
    client_key = scram.client_key(salted)
    assert client_key.hex() == example["client_key_hex"]
    assert scram.stored_key(client_key).hex() == example["stored_key_hex"]
    assert scram.server_key(salted).hex() == example["server_key_hex"]
    message = scram.auth_message(given["principal"], given["namespace"], client_nonce,
                                 server_nonce, salt, given["iterations"])
    assert message.decode() == example["auth_message"]
    proof = scram.client_proof(client_key, message)
    assert proof.hex() == example["client_proof_hex"]
    assert scram.proof_matches(bytes.fromhex(example["stored_key_hex"]), message, proof)
    assert not scram.proof_matches(bytes.fromhex(example["stored_key_hex"]), message,
                                   bytes(32))
    assert scram.server_signature(scram.server_key(salted), message).hex() == \
        example["server_signature_hex"]
    frames = {f["name"]: from_json(f["header"]) for f in load_auth_vectors()["frames"]}
    assert frames["hello_request_proof"][3][0]["proof"] == proof
    assert frames["auth_start_request"][3][1] == client_nonce


def test_both_sides_of_the_project_reproduce_the_worked_example(monkeypatch):
    vectors = load_auth_vectors()
    example, frames = vectors["scram"], {f["name"]: f for f in vectors["frames"]}
    given = example["inputs"]
    secret = bytes.fromhex(given["secret_hex"])
    request = lambda name: from_json(frames[name]["header"])  # noqa: E731
    # The client, with the example's nonce: the frames of the example, and it accepts the
    # example's signature.
    monkeypatch.setattr(client_auth.os, "urandom", lambda n: bytes.fromhex(
        given["client_nonce_hex"]))
    handshake = client_auth.handshake(given["namespace"], "vectors",
                                      client_auth.Credentials(given["principal"], secret))
    start = next(handshake)
    assert [start.method, start.params] == request("auth_start_request")[2:]
    hello = handshake.send(request("auth_start_response")[3])
    assert [hello.method, hello.params] == request("hello_request_proof")[2:]
    response = request("hello_response_signature")[3]
    with pytest.raises(StopIteration) as done:
        handshake.send(response)
    assert done.value.value == response
    # The daemon, holding the example's verifier and challenge: accepts the proof and answers
    # the example's signature.
    principal = credentials_file.Principal(
        given["principal"], {given["namespace"]: "read"}, bytes.fromhex(given["salt_hex"]),
        given["iterations"], bytes.fromhex(example["stored_key_hex"]),
        bytes.fromhex(example["server_key_hex"]))
    authenticator = daemon_auth.Authenticator("<example>", credentials_file.Credentials(
        {principal.name: principal}))

    class Connection:
        connection_id, transport_kind, transport, principal = 1, "tcp", None, None
        auth_challenge = (given["principal"], bytes.fromhex(given["client_nonce_hex"]),
                          bytes.fromhex(given["server_nonce_hex"]),
                          bytes.fromhex(given["salt_hex"]), given["iterations"])
    conn = Connection()
    options = request("hello_request_proof")[3][0]
    result = authenticator.authenticate(conn, options, options["namespace"])
    assert result == {"server_signature": bytes.fromhex(example["server_signature_hex"]),
                      "principal": given["principal"]}
    assert conn.principal == given["principal"] and conn.auth_challenge is None


@pytest.mark.parametrize("vector", load_auth_vectors()["frames"],
                         ids=[f["name"] for f in load_auth_vectors()["frames"]])
def test_auth_frames_encode_and_decode_as_the_vectors(vector):
    header = from_json(vector["header"])
    frame = bytes.fromhex(vector["frame_hex"])
    if header[0] == framing.REQUEST:
        built = framing.request_head(header[1], header[2], header[3])
    elif header[2] is None:
        built = framing.response_head(header[1], header[3])
    else:
        built = framing.error_head(header[1], *header[2])
    assert built.hex() == frame.hex()
    header_length, payload_length = framing.PREFIX.unpack_from(frame)
    assert payload_length == 0 and framing.PREFIX_BYTES + header_length == len(frame)
    decoded = framing.unpack_header(frame[framing.PREFIX_BYTES:], MAX_HEADER_BYTES)
    assert same(decoded, header)
    assert MAX_PAYLOAD_BYTES  # the daemon's default bounds hold these frames


# -- a cluster node -----------------------------------------------------------------------------

def test_a_cluster_node_checks_roles_too(credentials_path, monkeypatch):
    from cluster_harness import Cluster
    # The harness's own clients (leader checks) authenticate through the environment.
    monkeypatch.setenv("MOONCAKED_PRINCIPAL", "admin")
    monkeypatch.setenv("MOONCAKED_SECRET", SECRETS["admin"].decode())
    cluster = Cluster(3, auth={"credentials_file": credentials_path})
    try:
        leader = cluster.start().wait_for_leader()
        follower = next(i for i in cluster.nodes if i != leader)
        node = cluster.nodes[follower]
        with as_(node, "writer") as writer:
            assert writer.put("clustered", b"bytes") is True  # forwarded to the leader
            expect(ErrorCode.PERMISSION_DENIED, writer.call, "cluster_status")
            expect(ErrorCode.PERMISSION_DENIED, writer.call, "cluster_remove", leader)
        with as_(node, "reader") as reader:
            assert reader.get("clustered") == b"bytes"
            expect(ErrorCode.PERMISSION_DENIED, reader.put, "nope", b"x")
            expect(ErrorCode.PERMISSION_DENIED, reader.remove, "clustered")
        with as_(cluster.nodes[leader], "admin") as admin:
            assert admin.call("cluster_status")["leader"] == leader
            assert admin.get("clustered") == b"bytes"
            assert not admin.exists("nope")
    finally:
        cluster.close()


# -- shared memory follows the roles ------------------------------------------------------------

def test_only_a_principal_that_reads_every_namespace_maps_the_shared_segments(auth_daemon):
    """The shared segments hold every pool-less namespace's bytes: mapping them is for a
    principal that may read them all anyway; others move values through the socket."""
    def over_unix(name: str) -> BlockingClient:
        return BlockingClient.connect(auth_daemon.unix_address, namespace="a", principal=name,
                                      secret=SECRETS[name])
    value = os.urandom(5000)
    with over_unix("writer") as writer:
        assert writer.server["segments"] == [] and writer.server["fd_socket"] == ""
        assert writer.put("k", value) is True
        assert writer.get("k") == value
        expect(ErrorCode.NOT_SUPPORTED, writer.call, "get_replica", "k")
        expect(ErrorCode.NOT_SUPPORTED, writer.call, "put_start", "k2", 10)
    with over_unix("a-admin") as a_admin:  # admin of its own namespace only
        assert a_admin.server["segments"] == []
    with over_unix("admin") as admin:  # admin on "*": may read every namespace anyway
        assert admin.server["segments"]
        assert admin.get("k") == value
