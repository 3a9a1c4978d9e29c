"""TLS on the TCP listener (both event loops), in the clients and mooncakectl, on peer links,
and the cluster secret.

Certificates are made in the test with the `openssl` command line (tests/tls_certs.py): a CA,
a certificate for 127.0.0.1 / localhost signed by it, a client certificate, and a second CA
with a certificate of its own that nothing here trusts.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
import time

import pytest

from cluster_harness import Cluster, applied_replicas, peer_host
from conftest import REPO, free_port
from mooncaked import config as config_module
from mooncaked import tls
from mooncaked.client import aio
from mooncaked.client.blocking import BlockingClient
from mooncaked.client.calls import ReplicateConfig
from mooncaked.client.pool import ClientPool
from mooncaked.cluster.peer_security import PeerSecurity
from mooncaked.cluster.peer_transport import PeerLink, PeerServer
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.io import uring
from mooncaked.proto import framing
from tls_certs import make_pki

pytestmark = pytest.mark.skipif(
    subprocess.run(["sh", "-c", "command -v openssl"], capture_output=True).returncode != 0,
    reason="the openssl command line makes the test certificates (tools/install.sh installs it)")

SMALL = 4096
LARGE = 9 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


def tls_section(pki, **more) -> dict:
    return {"enabled": True, "cert_file": pki.server_cert, "key_file": pki.server_key,
            "ca_file": pki.ca, **more}


def value_of(size: int, tag: int) -> bytes:
    return (tag.to_bytes(8, "little") * (size // 8 + 1))[:size]


@pytest.fixture(params=["uring", "asyncio"])
def loop_name(request, monkeypatch):
    if request.param == "uring":
        ok, reason = uring.usable()
        if not ok:
            pytest.skip(f"io_uring loop not usable here: {reason}")
    monkeypatch.setenv("MOONCAKED_LOOP", request.param)
    return request.param


def loop_factory(name: str):
    return uring.new_event_loop if name == "uring" else asyncio.new_event_loop


# -- the TCP listener --------------------------------------------------------------------------

def test_put_get_over_tls_on_both_loops(make_daemon, pki, loop_name):
    daemon = make_daemon(tls=tls_section(pki))
    context = tls.client_context(pki.ca)
    with BlockingClient.connect(daemon.tcp_address, tls=context) as client:
        assert client.status()["loop"] == loop_name
        for tag, size in enumerate((1, SMALL, LARGE)):
            assert client.put(f"b{tag}", value_of(size, tag)) is True
            assert client.get(f"b{tag}") == value_of(size, tag)
        target = bytearray(LARGE)
        assert client.get_into("b2", target) == LARGE and target == value_of(LARGE, 2)
        assert client.batch_get(["b0", "b1"]) == [value_of(1, 0), value_of(SMALL, 1)]
        assert not client.peer_closed()  # an idle TLS connection is not taken for closed

    pool = ClientPool.connect(daemon.tcp_address, tls=context, max_connections=2)
    try:
        assert pool.get("b2") == value_of(LARGE, 2)
        assert pool.put("p", value_of(LARGE, 7)) is True and pool.get("p") == value_of(LARGE, 7)
    finally:
        pool.close()

    async def with_asyncio_client():
        client = await aio.Client.connect(daemon.tcp_address, tls=context)
        try:
            assert await client.put("a", value_of(LARGE, 3)) is True
            assert await client.get("a") == value_of(LARGE, 3)
            assert await client.get("b1") == value_of(SMALL, 1)
        finally:
            await client.close()
    # The asyncio client over TLS on either loop (TLSProtocol on ours).
    with asyncio.Runner(loop_factory=loop_factory(loop_name)) as runner:
        runner.run(with_asyncio_client())

    # The Unix socket stays plain.
    with BlockingClient.connect(daemon.unix_address) as local:
        assert local.get("a") == value_of(LARGE, 3)


def test_a_plain_client_is_refused_cleanly(make_daemon, pki, loop_name):
    daemon = make_daemon(tls=tls_section(pki))
    with pytest.raises(MooncakedError) as info:
        BlockingClient.connect(daemon.tcp_address, tls=False, timeout_s=10)
    assert info.value.code == ErrorCode.RPC_FAIL
    with BlockingClient.connect(daemon.tcp_address, tls=tls.client_context(pki.ca)) as client:
        assert client.status()["connections"] == 1  # the refused one left nothing behind
    assert "TLS connection with" in daemon.log()


def test_a_client_that_does_not_trust_the_ca_fails_verification(make_daemon, pki, monkeypatch):
    daemon = make_daemon(tls=tls_section(pki))
    with pytest.raises(ssl.SSLCertVerificationError):
        BlockingClient.connect(daemon.tcp_address, tls=tls.client_context(pki.other_ca))
    # The host name is checked too: the certificate names 127.0.0.1 and localhost only.
    monkeypatch.setenv(tls.ENV_SERVER_NAME, "elsewhere.example")
    with pytest.raises(ssl.SSLCertVerificationError):
        BlockingClient.connect(daemon.tcp_address, tls=tls.client_context(pki.ca))


def test_require_client_cert_rejects_clients_without_a_trusted_cert(make_daemon, pki):
    daemon = make_daemon(tls=tls_section(pki, require_client_cert=True))
    for context in (tls.client_context(pki.ca),
                    tls.client_context(pki.ca, pki.other_cert, pki.other_key)):
        with pytest.raises((MooncakedError, ssl.SSLError)):
            BlockingClient.connect(daemon.tcp_address, tls=context, timeout_s=10)
    with BlockingClient.connect(daemon.tcp_address, tls=tls.client_context(
            pki.ca, pki.client_cert, pki.client_key)) as client:
        assert client.put("k", b"v") is True and client.get("k") == b"v"


def test_clients_take_tls_settings_from_the_environment(make_daemon, pki, monkeypatch):
    daemon = make_daemon(tls=tls_section(pki, require_client_cert=True))
    monkeypatch.setenv(tls.ENV_CA, pki.ca)
    monkeypatch.setenv(tls.ENV_CERT, pki.client_cert)
    monkeypatch.setenv(tls.ENV_KEY, pki.client_key)
    pool = ClientPool.connect(daemon.tcp_address)  # as the Mooncake facade opens it
    try:
        assert pool.put("env", b"x" * SMALL) is True and pool.get("env") == b"x" * SMALL
    finally:
        pool.close()
    # The settings apply to TCP only: a Unix socket client does not even read the files.
    monkeypatch.setenv(tls.ENV_CA, pki.ca + ".missing")
    with pytest.raises(FileNotFoundError):
        ClientPool.connect(daemon.tcp_address)
    pool = ClientPool.connect(daemon.unix_address)
    try:
        assert pool.get("env") == b"x" * SMALL
    finally:
        pool.close()


def ctl(*args, env=None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_TLS")}
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", *args], capture_output=True,
                          text=True, timeout=60,
                          env=dict(environment, PYTHONPATH=REPO, **(env or {})))


def test_mooncakectl_over_tls(make_daemon, pki):
    daemon = make_daemon(tls=tls_section(pki, require_client_cert=True))
    address = ["-a", daemon.tcp_address, "-o", "json"]
    out = ctl(*address, "--tls-ca", pki.ca, "--tls-cert", pki.client_cert,
              "--tls-key", pki.client_key, "status")
    assert out.returncode == 0, out.stderr
    assert '"node_name": "test-node"' in out.stdout
    out = ctl(*address, "status", env={tls.ENV_CA: pki.ca, tls.ENV_CERT: pki.client_cert,
                                       tls.ENV_KEY: pki.client_key})
    assert out.returncode == 0, out.stderr
    out = ctl(*address, "--tls-ca", pki.other_ca, "status")
    assert out.returncode == 1 and "certificate verify failed" in out.stderr, out.stderr
    out = ctl(*address, "status")  # plain
    assert out.returncode == 1 and out.stderr.startswith("mooncakectl: "), out.stderr
    out = ctl(*address, "--tls-cert", pki.client_cert, "status")
    assert out.returncode == 1 and "need --tls-ca" in out.stderr


# -- configuration checks ----------------------------------------------------------------------

def load(tmp_path, tls_values: dict, **sections) -> str:
    """The ConfigError message of a config with these [tls] values ("" when it loads)."""
    try:
        config_module.from_dict({"tls": tls_values, **sections}, str(tmp_path / "m.toml"))
    except config_module.ConfigError as exc:
        return str(exc)
    return ""


def test_tls_config_is_checked_at_load(tmp_path, pki):
    good = tls_section(pki)
    assert load(tmp_path, good) == ""
    assert "needs cert_file and key_file" in load(tmp_path, {"enabled": True})
    missing = str(tmp_path / "missing.pem")
    message = load(tmp_path, {**good, "cert_file": missing})
    assert "[tls] cert_file" in message and missing in message and "cannot read" in message
    open_key = str(tmp_path / "open.key")
    with open(pki.server_key, "rb") as source, open(open_key, "wb") as f:
        f.write(source.read())
    os.chmod(open_key, 0o644)
    message = load(tmp_path, {**good, "key_file": open_key})
    assert "accessible by group or others" in message and "0o644" in message
    if os.geteuid() != 0:  # root reads a 0o000 file anyway
        os.chmod(open_key, 0o000)
        assert "cannot read" in load(tmp_path, {**good, "key_file": open_key})
    message = load(tmp_path, {**good, "key_file": pki.client_key})  # not the cert's key
    assert "not a certificate and its matching key" in message
    message = load(tmp_path, {**good, "ca_file": "", "require_client_cert": True})
    assert "require_client_cert needs ca_file" in message
    message = load(tmp_path, {**good, "ca_file": pki.server_key})
    assert "no usable CA certificate" in message
    message = load(tmp_path, {**good, "ca_file": ""}, cluster={"enabled": True, "node_id": 1})
    assert "needs ca_file" in message


def test_cluster_secret_file_is_checked_at_load(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    assert load(tmp_path, {}, cluster={"secret_file": str(secret)}) == ""
    secret.chmod(0o640)
    assert "accessible by group or others" in load(tmp_path, {},
                                                   cluster={"secret_file": str(secret)})
    secret.chmod(0o600)
    secret.write_bytes(b"short")
    assert "at least 16" in load(tmp_path, {}, cluster={"secret_file": str(secret)})


# -- peer links, in one process ----------------------------------------------------------------

SEGMENT = 1 << 20


class PeerNode:
    """A peer server over a bytearray segment (as tests/test_peer_transport.py's Node)."""

    def __init__(self, security: PeerSecurity | None) -> None:
        self.segment = bytearray(SEGMENT)
        self.hellos: list = []
        self.requests: list = []
        self.server = PeerServer(lambda i, a: self.hellos.append((i, a)), lambda data: None,
                                 self.on_request, 16 << 20, self.payload_target, security)

    def payload_target(self, method, params, length):
        if method == "write_replica":
            return memoryview(self.segment)[params[0]:params[0] + length]
        return None

    async def on_request(self, method, params, payload):
        self.requests.append(method)
        if method == "read":
            return SEGMENT, [self.segment]
        return 0, None

    async def link(self, security: PeerSecurity | None) -> PeerLink:
        port = self.server.port or await self.server.start("127.0.0.1", 0)
        return PeerLink(7, "127.0.0.1:1", 1, lambda: f"127.0.0.1:{port}", 16 << 20, 5.0,
                        security=security)


def secret_security(secret: bytes) -> PeerSecurity:
    return PeerSecurity(secret=secret)


def tls_security(cert: str, key: str, ca: str, secret: bytes | None = None) -> PeerSecurity:
    config = config_module.TLSConfig(enabled=True, cert_file=cert, key_file=key, ca_file=ca)
    server, client = tls.peer_contexts(config)
    return PeerSecurity(server, client, secret)


@pytest.fixture(params=["uring", "asyncio"])
def peer_loop(request):
    if request.param == "uring" and not uring.usable()[0]:
        pytest.skip("io_uring loop not usable here")
    return loop_factory(request.param)


def run(factory, coroutine):
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(asyncio.wait_for(coroutine, 60))


async def write_and_read(link: PeerLink, node: PeerNode) -> None:
    value = os.urandom(SEGMENT // 2)
    await link.call("write_replica", [100], [value])
    _, payload = await link.call("read", [])
    assert bytes(payload[100:100 + len(value)]) == value


async def refused(link: PeerLink, node: PeerNode) -> None:
    """Every call fails, and none of them reached the node."""
    before = bytes(node.segment)
    for method, payload in (("write_replica", [b"\xff" * 4096]), ("read", None)):
        with pytest.raises(MooncakedError) as info:
            await link.call(method, [0], payload, timeout_s=5)
        assert info.value.code in (ErrorCode.RPC_FAIL, ErrorCode.RPC_TIMEOUT)
    assert node.hellos == [] and node.requests == [] and bytes(node.segment) == before


def test_peers_with_the_cluster_secret_talk(peer_loop):
    async def main():
        node = PeerNode(secret_security(b"s" * 32))
        link = await node.link(secret_security(b"s" * 32))
        try:
            await write_and_read(link, node)
            assert node.hellos == [(7, "127.0.0.1:1")]
        finally:
            link.close()
            node.server.close()
    run(peer_loop, main())


@pytest.mark.parametrize("client_secret", [b"w" * 32, None])
def test_a_peer_without_the_secret_is_refused(peer_loop, client_secret):
    async def main():
        node = PeerNode(secret_security(b"s" * 32))
        link = await node.link(secret_security(client_secret) if client_secret else None)
        try:
            await refused(link, node)
        finally:
            link.close()
            node.server.close()
    run(peer_loop, main())


def test_a_node_does_not_talk_to_a_peer_that_lacks_the_secret(peer_loop):
    """The connecting side checks the accepting side's proof too: a listener that does not
    know the secret gets nothing (no Raft message, no replica bytes)."""
    async def main():
        secret = b"s" * 32
        received = []

        async def impostor(reader, writer):  # sends a challenge, then a wrong proof
            writer.write(framing.frame_head([framing.NOTIFICATION, "peer_challenge",
                                             [os.urandom(32)]]))
            received.append(await reader.read(65536))  # the hello
            writer.write(framing.frame_head([framing.NOTIFICATION, "peer_hello_ok",
                                             [b"\0" * 32]]))
            received.append(await reader.read(65536))  # b"" once the link gives up
            writer.close()
        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = PeerLink(7, "127.0.0.1:1", 1, lambda: f"127.0.0.1:{port}", 1 << 20, 5.0,
                        security=secret_security(secret))
        try:
            with pytest.raises(MooncakedError) as info:
                await link.call("write_replica", [0], [b"secret bytes"], timeout_s=5)
            assert "does not know the cluster secret" in info.value.message
            assert not link.send_raft(b"raft")
            await asyncio.sleep(0.2)
            assert received[-1] == b"" and all(b"secret bytes" not in r for r in received)
        finally:
            link.close()
            server.close()
    # asyncio.start_server: the impostor runs on asyncio's loop.
    run(asyncio.new_event_loop, main())


def test_mutual_tls_peer_links(peer_loop, pki):
    async def main():
        member = tls_security(pki.server_cert, pki.server_key, pki.ca)
        node = PeerNode(member)
        link = await node.link(tls_security(pki.client_cert, pki.client_key, pki.ca))
        stranger = await node.link(tls_security(pki.other_cert, pki.other_key, pki.ca))
        plain = await node.link(None)
        try:
            await write_and_read(link, node)
            node.hellos.clear()
            node.requests.clear()
            await refused(stranger, node)  # a certificate of another CA
            await refused(plain, node)  # no TLS at all
        finally:
            for each in (link, stranger, plain):
                each.close()
            node.server.close()
    run(peer_loop, main())


def test_a_node_does_not_talk_to_a_peer_with_an_untrusted_cert(peer_loop, pki):
    async def main():
        node = PeerNode(tls_security(pki.other_cert, pki.other_key, pki.other_ca))
        link = await node.link(tls_security(pki.client_cert, pki.client_key, pki.ca))
        try:
            await refused(link, node)
        finally:
            link.close()
            node.server.close()
    run(peer_loop, main())


# -- clusters ----------------------------------------------------------------------------------

def write_secret(directory: str, name: str, secret: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return path


def start_rogue(harness: Cluster, node_id: int, join_via: int, **sections) -> None:
    """A daemon with these config sections that tries to join through `join_via`; it never
    becomes ready (its join is refused)."""
    members_overrides = harness.overrides
    harness.overrides = {name: {**members_overrides.get(name, {}), **sections.get(name, {})}
                         for name in {*members_overrides, *sections}}
    try:
        harness.peer_ports[node_id] = free_port(peer_host(node_id))
        node = harness._make(node_id, "")
    finally:
        harness.overrides = members_overrides
    node.extra_args = ["--join", f"{peer_host(join_via)}:{harness.peer_ports[join_via]}"]
    harness.nodes[node_id] = node
    with pytest.raises(TimeoutError):
        node.start(timeout_s=4)


def assert_cluster_unchanged(cluster: Cluster, rogue_id: int, victim: int,
                             refusal: str) -> None:
    leader = cluster.wait_for_leader(among=[1, 2, 3])
    status = cluster.status(leader)
    assert sorted(status["voters"]) == [1, 2, 3] and status["learners"] == []
    assert rogue_id not in {n["node_id"] for n in status["nodes"]}
    assert refusal in cluster.nodes[victim].log()


def test_three_nodes_with_mutual_tls_and_a_stranger_refused(pki, monkeypatch):
    monkeypatch.setenv(tls.ENV_CA, pki.ca)  # the harness's clients speak TLS
    # One certificate for every member: peers check the CA's signature, not a name.
    cluster = Cluster(3, tls=tls_section(pki))
    try:
        cluster.start()
        with cluster.client(1) as writer:
            assert writer.put("tls", value_of(LARGE, 5)) is True
        with cluster.client(3) as reader:
            assert reader.get("tls") == value_of(LARGE, 5)
        assert "peers authenticated by mutual TLS" in cluster.nodes[1].log()
        # A node whose certificate another CA signed cannot join (it trusts the cluster's CA,
        # so it is the member that refuses it).
        start_rogue(cluster, 4, join_via=2,
                    tls={"cert_file": pki.other_cert, "key_file": pki.other_key})
        assert_cluster_unchanged(cluster, 4, victim=2, refusal="TLS connection with")
        with cluster.client(2) as reader:
            assert reader.get("tls") == value_of(LARGE, 5)
    finally:
        cluster.close()


def test_a_process_without_the_cluster_secret_cannot_join_forward_or_write(tmp_path):
    secret = write_secret(str(tmp_path), "secret", os.urandom(32).hex().encode())
    wrong = write_secret(str(tmp_path), "wrong", os.urandom(32).hex().encode())
    cluster = Cluster(3, cluster={"secret_file": secret})
    try:
        cluster.start()
        assert "peers authenticated by cluster secret" in cluster.nodes[1].log()
        with cluster.client(1) as writer:  # its one replica on node 2, which is attacked
            assert writer.put("kept", value_of(SMALL, 1),
                              ReplicateConfig(preferred_segments=["node2/0"])) is True
            [replica] = applied_replicas(writer, "kept")
        with cluster.client(3) as reader:
            assert reader.get("kept") == value_of(SMALL, 1)
        start_rogue(cluster, 4, join_via=2, cluster={"secret_file": wrong})
        assert_cluster_unchanged(cluster, 4, victim=2,
                                 refusal="does not know the cluster secret")
        # By hand: a forged hello, then replica bytes over the value's replica, and a join
        # forwarded to the leader. The refused hello closes the connection, so the sends
        # after it may fail: that is the expected outcome.
        status = cluster.status(2)
        with cluster.client(2) as client:
            assert replica["segment_id"] in {s["id"] for s in client.segment_report()}
        with socket.create_connection((peer_host(2), cluster.peer_ports[2]), 5) as sock:
            sock.settimeout(5)
            challenge = sock.recv(65536)
            assert b"peer_challenge" in challenge
            frames = [framing.request_head(0, "peer_hello", [9, "127.0.0.1:9", os.urandom(32),
                                                              b"\0" * 32])]
            frames.append(framing.request_head(1, "write_replica", [replica["segment_id"],
                                                                    replica["offset"]], SMALL)
                          + b"\xee" * SMALL)
            frames.append(framing.request_head(2, "meta_forward",
                                               ["join", [9, "127.0.0.1:9"]]))
            received = b""
            try:
                for frame in frames:
                    sock.sendall(frame)
                while chunk := sock.recv(65536):
                    received += chunk
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                pass
            assert b"peer_hello_ok" not in received and b"\xee" not in received
        time.sleep(0.5)
        after = cluster.status(2)
        assert after["voters"] == status["voters"] and after["learners"] == []
        assert after["replica_bytes_received"] == status["replica_bytes_received"]
        for node_id in (1, 2, 3):
            with cluster.client(node_id) as reader:
                assert reader.get("kept") == value_of(SMALL, 1)
    finally:
        cluster.close()


def test_a_cluster_node_warns_when_its_peer_links_are_open_to_the_network(tmp_path):
    """Peer links without a secret or TLS, on a non-loopback listener: said at start."""
    secret = write_secret(str(tmp_path), "secret", os.urandom(32).hex().encode())
    logs = {}
    for name, extra in (("open", {}), ("secret", {"secret_file": secret})):
        cluster = Cluster(1, cluster={"peer_host": "0.0.0.0", "advertise_host": "127.0.0.1",
                                      **extra})
        try:
            cluster.start()
            logs[name] = cluster.nodes[1].log()
        finally:
            cluster.close()
    assert "peer links are not authenticated" in logs["open"]
    assert "peer links are not authenticated" not in logs["secret"]
