"""The cluster section of the benchmark (run.py --only cluster), per CPU placement:

    put 4 KiB ops/s     1 and 8 client processes over TCP, each its own connection, on a
                        3-node cluster (through the leader and through a follower), a 1-node
                        cluster and the plain daemon (cluster off), and Mooncake's master with
                        1 and 8 clients (the `rate` worker every other small-op row uses); the
                        Raft logs use fsync = "batch" on the work directory's file system (a
                        disk, not tmpfs; the table says which)
    batch_put keys/s    32 x 4 KiB fresh keys per call, 1 client: mooncaked's batch_put on the
                        3-node cluster (leader, follower) vs Mooncake's batch_put_from of a
                        registered buffer (the same keys and values)
    cross-node get      1 MiB and 16 MiB values whose replica sits on node A's segment
                        (preferred_segments), read by a local client of node B over its Unix
                        socket (A -> B's get staging area, which the client maps; the client
                        copies out) and, for reference, by a TCP client of B (A -> B -> client),
                        vs Mooncake: client A puts into its own segment, client B (another
                        process, no segment) gets over Mooncake's TCP transport
    failover            kill -9 of the leader (by PID) while a client puts in a loop through a
                        follower: time to a new leader in cluster_status and to the first
                        successful put; the killed node is restarted between trials; then
                        `cluster transfer-leader` handovers, timed the same way

The three daemons of the cluster share the placement's server CPUs (they are each other's
peers there, so they do not busy-poll), and the 1-node and plain daemons poll exactly as they
do (BUSY_POLL): every mooncaked row of the section runs on equal settings. Clients, the
control worker and the put loop run on the client CPUs. Everything is stopped by PID at the
end.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time

import report
from common import GiB, MiB, new_nonce
from procs import PROCS, Noise, Worker, free_port, run_one
from servers import (await_mooncaked, daemon_knows, relaunch_mooncaked, start_mooncake_master,
                     start_mooncaked)

PUT_OPS = (("cl_put_1p", 1), ("cl_put_8p", 8))
BATCH_PUT_OP, BATCH_PUT_KEYS = "cl_batch_put_1p", 32
# One busy-poll setting for every mooncaked daemon of the section (3-node, 1-node, plain).
BUSY_POLL = False


def filesystem_of(path: str) -> str:
    """'ext4 on /dev/vda' for the mount that holds path."""
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", path],
                             capture_output=True, text=True, timeout=10).stdout.split()
        if len(out) >= 2:
            return f"{out[0]} on {out[1]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown file system"


def supported(src: str) -> bool:
    """Whether the checkout's daemon has a [cluster] section."""
    return daemon_knows(src, "initial_members")


class ClusterSection:
    def __init__(self, bench) -> None:
        self.b = bench
        self.cfg = bench.cfg
        self.res = bench.results
        self.info = bench.info.setdefault("cluster", {})

    # -- servers -------------------------------------------------------------------------------

    def start_cluster(self, pl, size: int, label: str, segment_bytes: int) -> list:
        """`size` daemons with [cluster] enabled, spawned side by side; returns their Servers
        (index = node id - 1); await_mooncaked() each before use."""
        peers = {i: free_port() for i in range(1, size + 1)}
        members = ",".join(f"{i}@127.0.0.1:{port}" for i, port in peers.items())
        nodes = []
        try:
            for i in peers:
                # (the last component names the node's private /dev/shm directory)
                workdir = os.path.join(self.b.workdir, f"{label}-{pl.name}-node{i}")
                cluster = {"node_id": i, "peer_host": "127.0.0.1", "peer_port": peers[i],
                           "initial_members": members,
                           "data_dir": os.path.join(workdir, "raft"),
                           "fsync": self.cfg.cluster_fsync}
                # A Unix socket too: the cross-node get's local client (get staging area).
                server = start_mooncaked(
                    self.b.py, workdir, pl, segment_bytes, None,
                    self.b.logfile(f"{label}-{pl.name}-node{i}"), unix_socket=True,
                    cluster=cluster, busy_poll=BUSY_POLL, name=f"node{i}",
                    wait=False)
                nodes.append(server)
                self.b.info["servers"][f"{label} node{i} [{pl.name}]"] = server.command
        except BaseException:
            self.stop_all(nodes)
            raise
        return nodes

    def start_plain(self, pl, label: str):
        workdir = os.path.join(self.b.workdir, f"{label}-{pl.name}")
        server = start_mooncaked(self.b.py, workdir, pl, self.cfg.cluster_small_segment, None,
                                 self.b.logfile(f"{label}-{pl.name}"), unix_socket=False,
                                 busy_poll=BUSY_POLL, wait=False)
        self.b.info["servers"][f"{label} [{pl.name}]"] = server.command
        return server

    @staticmethod
    def stop_all(servers) -> None:
        for server in servers:
            if server is None:
                continue
            server.stop()
            shutil.rmtree(server.connect["shm_dir"], ignore_errors=True)

    def ctl(self, pl, nodes) -> Worker:
        addresses = {str(i + 1): n.connect["tcp_address"] for i, n in enumerate(nodes)}
        w = Worker(self.b.py, "cluster_ctl", {"nodes": addresses},
                   self.b.logfile("cluster-ctl"), pl.clients)
        w.expect("READY", 60)
        return w

    @staticmethod
    def command(ctl: Worker, **cmd):
        """A cluster_ctl command; waits for its answer a bit longer than its own limit."""
        ctl.send(json.dumps(cmd))
        return ctl.expect("RESULT", cmd.get("limit_s", 60) + 30)

    def settle(self, ctl: Worker, expect: list[int], what: str) -> dict:
        out = self.command(ctl, cmd="wait_settled", expect=expect, limit_s=60)
        if not out["settled"]:
            errors = {k: v.get("error") for k, v in out["views"].items() if "error" in v}
            raise RuntimeError(f"{what}: no settled cluster within 60 s (leader "
                               f"{out['leader']}; errors {errors}); see the node logs in "
                               f"{self.b.workdir}")
        return out

    # -- the section ---------------------------------------------------------------------------

    def run(self, pl, with_mooncake: bool) -> None:
        cfg, b = self.cfg, self.b
        data_fs = filesystem_of(b.workdir)
        self.info["raft_data_fs"] = data_fs
        self.info["settings"] = {"fsync": cfg.cluster_fsync, "tick_ms": "default (100)",
                                 "election_ticks": "default (10)",
                                 "node_ttl_ms": "default (5000)",
                                 "segment_bytes_3node": cfg.cluster_segment,
                                 "allocation_strategy": "default (random)"}
        three = one = plain = master = None
        ctl3 = ctl1 = None
        try:
            three = self.start_cluster(pl, 3, "cluster3", cfg.cluster_segment)
            # the others start while the 3-node cluster elects its leader
            one = self.start_cluster(pl, 1, "cluster1", cfg.cluster_small_segment)
            plain = self.start_plain(pl, "plain-tcp")
            for server in three + one + [plain]:
                await_mooncaked(server)
            self.info.setdefault("busy_poll_us", {})[pl.name] = {
                "3-node": three[0].connect["busy_poll_us"],
                "1-node": one[0].connect["busy_poll_us"],
                "plain": plain.connect["busy_poll_us"]}
            if with_mooncake:
                master = start_mooncake_master(b.vpy, pl, b.logfile("mooncake_master-cluster"))
                b.info["servers"][f"mooncake_master (cluster section) [{pl.name}]"] = \
                    master.command
            ctl3 = self.ctl(pl, three)
            settled = self.settle(ctl3, [1, 2, 3], "3-node cluster")
            leader = settled["leader"]
            followers = [i for i in (1, 2, 3) if i != leader]
            b.log(f"[{pl.name}] 3-node cluster: pids "
                  f"{[n.process.pid for n in three]}, leader node{leader}, Raft logs on "
                  f"{data_fs}, settled after {settled['waited_s']:.1f} s")
            status = self.command(ctl3, cmd="status")
            self.info.setdefault("loops", {})[f"3-node [{pl.name}]"] = {
                k: (v["status"] or {}).get("loop") for k, v in status.items()}
            ctl1 = self.ctl(pl, one)
            self.settle(ctl1, [1], "1-node cluster")
            addr = lambda node_id: three[node_id - 1].connect["tcp_address"]  # noqa: E731
            pids3 = [n.process.pid for n in three]  # the servers' CPU: all three nodes
            targets = [("mcd-3node-leader", self.b.py,
                        {"system": "mooncaked", "address": addr(leader), "server_pids": pids3},
                        None),
                       ("mcd-3node-follower", self.b.py,
                        {"system": "mooncaked", "address": addr(followers[0]),
                         "server_pids": pids3}, None),
                       ("mcd-1node", self.b.py,
                        {"system": "mooncaked", "address": one[0].connect["tcp_address"],
                         "server_pids": [one[0].process.pid]}, None),
                       ("mcd-plain", self.b.py,
                        {"system": "mooncaked", "address": plain.connect["tcp_address"],
                         "server_pids": [plain.process.pid]}, None)]
            mooncake = None
            if master is not None:
                mooncake = ("mooncake", b.vpy,
                            dict(master.connect, system="mooncake",
                                 server_pids=[master.process.pid],
                                 segment_bytes=cfg.mooncake_rate_segment,
                                 local_buffer_bytes=cfg.mooncake_rate_buffer), b.venv_env)
            self.put_rates(pl, targets, mooncake)
            b.log(f"[{pl.name}] cluster: put 4 KiB rates done")
            self.stop_all([one[0], plain])
            ctl1.send('{"cmd": "stop"}'); ctl1.finish(10); ctl1 = None
            one = plain = None
            self.cross_get(pl, three, leader, followers, master)
            b.log(f"[{pl.name}] cluster: cross-node get done")
            if master is not None:
                master.stop(); master = None
            self.failover(pl, three, ctl3)
            b.log(f"[{pl.name}] cluster: failover done")
        finally:
            for w in (ctl3, ctl1):
                if w is not None:
                    try:
                        w.send('{"cmd": "stop"}')
                    except OSError:
                        pass
                    w.finish(10)
            if master is not None:
                master.stop()
            self.stop_all([plain] + (one or []) + (three or []))

    # -- put 4 KiB -----------------------------------------------------------------------------

    def put_rates(self, pl, targets: list, mooncake) -> None:
        """Trials alternate between the systems, so that drift in the machine's load hits all.
        targets[:2] are the 3-node cluster's (leader, follower): they also run batch_put."""
        cfg, b = self.cfg, self.b
        plan = [(op, "put", nproc, t) for op, nproc in PUT_OPS for t in targets]
        plan += [(BATCH_PUT_OP, "batch_put", 1, t) for t in targets[:2]]
        if mooncake is not None:  # its usual put path; batch_put_from of the same keys
            plan += [(op, "put", nproc, mooncake) for op, nproc in PUT_OPS]
            plan.append((BATCH_PUT_OP, "batch_put", 1, mooncake))
        acc = {(op, t[0]): {"values": [], "p50": [], "p99": [], "n": [], "noise": [],
                            "errors": 0, "cpu": [], "checked": 0, "bad": 0}
               for op, _, _, t in plan}
        disk, disk_noise = [], []  # the disk's fsync latency moves with the host's load
        for trial in range(cfg.trials):
            with Noise(disk_noise):
                disk.append(run_one(b.vpy, "fdatasync",
                                    {"dir": b.workdir, "duration_s": cfg.cluster_rate_s},
                                    b.logfile("machine"), pl.servers))
            for op, mode, nproc, (label, python, base, env) in plan:
                a = acc[(op, label)]
                args = dict(base, mode=mode, duration_s=cfg.cluster_rate_s, keys=0,
                            batch=BATCH_PUT_KEYS,
                            tag=f"{pl.name}-{label}-{op}-{trial}-{os.getpid()}")
                if mode == "batch_put" and label == "mooncake":
                    # Room for every key of the window: Mooncake evicts when its segment
                    # fills, and an evicted key fails the read-back check.
                    args["segment_bytes"] = cfg.cluster_batch_mooncake_segment
                try:
                    r = b.rate(python, args, nproc, pl.clients, a["noise"], env)
                except RuntimeError as exc:  # a worker that died: a failed trial
                    b.info["errors"].append(f"cluster {label} {op} [{pl.name}] trial {trial}: "
                                            f"{exc}")
                    a["values"].append(None)
                    continue
                a["values"].append(r["rate"]); a["p50"].append(r["p50_us"])
                a["p99"].append(r["p99_us"]); a["n"].append(r["n"])
                a["errors"] += r["errors"]; a["checked"] += r["checked"]; a["bad"] += r["bad"]
                a["cpu"].append({"units": r["n"], "bytes": 0, "wall_s": r["span_s"],
                                 "server_cpu_s": r["server_cpu_s"],
                                 "client_cpu_s": r["client_cpu_s"]})
        self.res.add(pl.name, "machine", "fdatasync_4k", None, "ops/s",
                     [o["ops_s"] for o in disk], [o["p50_us"] for o in disk],
                     [o["p99_us"] for o in disk], disk_noise,
                     note=f"4 KiB append + fdatasync, one after the other, in the work dir "
                          f"({self.info['raft_data_fs']}), on the server CPUs; once per trial "
                          "of the put rates, just before them")
        nprocs = dict(PUT_OPS, **{BATCH_PUT_OP: 1})
        for (op, label), a in acc.items():
            nproc = nprocs[op]
            note = (f"{nproc} client process{'es' if nproc > 1 else ''} over "
                    + ("Mooncake's RPC" if label == "mooncake" else "TCP")
                    + "; trials alternate between the systems")
            if op == BATCH_PUT_OP:
                note = (f"{BATCH_PUT_KEYS} x 4 KiB fresh keys per call ("
                        + ("batch_put_from of a registered buffer" if label == "mooncake"
                           else "batch_put") + "), keys/s; p50/p99 per call; " + note)
            if label.startswith("mcd-") and label != "mcd-plain":
                note += f"; fsync={cfg.cluster_fsync} on {self.info['raft_data_fs']}"
            self.res.add(pl.name, label, op, None,
                         "keys/s" if op == BATCH_PUT_OP else "ops/s", a["values"], a["p50"],
                         a["p99"], a["noise"],
                         n=int(statistics.median(a["n"])) if a["n"] else None, note=note,
                         errors=a["errors"], cpu=a["cpu"], checked=a["checked"], bad=a["bad"])

    # -- cross-node get ------------------------------------------------------------------------

    def cross_get(self, pl, three, leader: int, followers: list[int], master) -> None:
        cfg, b = self.cfg, self.b
        holder, via = followers
        addr = lambda node_id: three[node_id - 1].connect["tcp_address"]  # noqa: E731
        tag = f"{pl.name}-cross-{os.getpid()}"
        sizes = cfg.cross_sizes
        nonce = new_nonce()  # the values carry their index and this nonce
        writers, readers = [], []
        try:
            w = Worker(b.py, "cross_writer",
                       {"system": "mooncaked", "tag": tag, "sizes": sizes, "address": addr(via),
                        "nonce": nonce,
                        "holder_address": addr(holder), "segment": f"node{holder}/0"},
                       b.logfile("cross-writer"), pl.clients)
            writers.append(w)
            put = w.expect("READY", 300)
            placed = all(p["on_holder"] for p in put["placement"].values())
            self.info.setdefault("cross_placement", {})[pl.name] = {
                "holder": f"node{holder}", "client_node": f"node{via}", "leader": f"node{leader}",
                "replicas_on_holder": placed, "detail": put["placement"]}
            for size, n in sizes:
                x = put["put"][str(size)]
                self.res.add(pl.name, "mcd-3node", "cross_put", size, "MB/s", [x["mbps"]],
                             [x["p50_us"]], [x["p99_us"]], n=n, errors=x["errors"],
                             note=f"client on node{via} puts with preferred_segments="
                                  f"node{holder}/0 (bytes cross node to node); once")
            # Local clients (Unix socket: the node's get staging area, mapped); the same
            # through TCP for reference (the bytes then cross B's client socket as well).
            local = lambda node_id: three[node_id - 1].connect["address"]  # noqa: E731
            readers.append(("mcd-3node-via-follower", b.py, {"system": "mooncaked",
                                                             "address": local(via)}, None))
            readers.append(("mcd-3node-via-leader", b.py, {"system": "mooncaked",
                                                           "address": local(leader)}, None))
            readers.append(("mcd-3node-via-follower-tcp", b.py, {"system": "mooncaked",
                                                                 "address": addr(via)}, None))
            if master is not None:
                base = dict(master.connect, system="mooncake", tag=tag, sizes=sizes,
                            local_buffer_bytes=cfg.mooncake_buffer, nonce=nonce)
                w = Worker(b.vpy, "cross_writer", dict(base, segment_bytes=cfg.mooncake_segment),
                           b.logfile("cross-writer-mooncake"), pl.servers, b.venv_env)
                writers.append(w)
                put = w.expect("READY", 300)
                for size, n in sizes:
                    x = put["put"][str(size)]
                    self.res.add(pl.name, "mooncake", "cross_put", size, "MB/s", [x["mbps"]],
                                 [x["p50_us"]], [x["p99_us"]], n=n, errors=x["errors"],
                                 note="client A puts into its own segment (a local copy: "
                                      "TCP-only build); once; A runs on the server CPUs")
                readers.append(("mooncake", b.vpy, dict(base, segment_bytes=0), b.venv_env))
            acc = {r[0]: {"out": [], "noise": []} for r in readers}
            for trial in range(cfg.trials):
                for label, python, args, env in readers:
                    with Noise(acc[label]["noise"]):
                        acc[label]["out"].append(run_one(
                            python, "cross_reader", dict(args, tag=tag, sizes=sizes, nonce=nonce),
                            b.logfile(f"cross-reader-{label}"), pl.clients, env, timeout_s=300))
            self.info.setdefault("cross_staging", {})[pl.name] = {
                label: [o.get("get_staging") for o in a["out"]] for label, a in acc.items()}
            for label, a in acc.items():
                verified = all(o["verified"] for o in a["out"])
                for size, n in sizes:
                    xs = [o["get"][str(size)] for o in a["out"]]
                    note = "" if verified else "VERIFY FAILED"
                    checked = sum(x.get("checked", 0) for x in xs)
                    bad = sum(x.get("bad", 0) for x in xs)
                    if label.startswith("mcd") and not placed:
                        note = (note + " REPLICA NOT ON THE HOLDER NODE").strip()
                    self.res.add(pl.name, label, "cross_get", size, "MB/s",
                                 [x["mbps"] for x in xs], [x["p50_us"] for x in xs],
                                 [x["p99_us"] for x in xs], a["noise"], n=n, note=note,
                                 errors=sum(x["errors"] for x in xs), checked=checked,
                                 bad=bad)
        finally:
            for w in writers:
                try:
                    w.send("DONE")
                    w.expect("RESULT", 60)
                except (OSError, RuntimeError):
                    pass
                w.finish(30)

    # -- failover ------------------------------------------------------------------------------

    def put_loop(self, pl, three, node_id: int, tag: str) -> Worker:
        w = Worker(self.b.py, "put_loop",
                   {"address": three[node_id - 1].connect["tcp_address"], "tag": tag,
                    "segment": f"node{node_id}/0"},
                   self.b.logfile("put-loop"), pl.clients)
        w.expect("READY", 60)
        w.send("GO")
        return w

    @staticmethod
    def end_put_loop(w: Worker, event: float) -> dict:
        """out["recovered"] is False when no put succeeded within 60 s of the event: the trial
        is kept, as a failed trial (its times are None), not dropped."""
        w.send(f"EVENT {event!r}")
        recovered = True
        try:
            w.expect("RECOVERED", 60)
        except RuntimeError:
            recovered = False
        finally:
            w.send("STOP")
            out = w.expect("RESULT", 60)
            w.finish(30)
        out["recovered"] = recovered
        if not recovered:
            out["first_ok_s"] = None
        return out

    def failover(self, pl, three, ctl: Worker) -> None:
        cfg, b = self.cfg, self.b
        rows = {k: [] for k in ("failover_new_leader", "failover_first_put", "failover_put_gap",
                                "failover_restart", "transfer_return", "transfer_new_leader",
                                "transfer_first_put", "transfer_put_gap")}
        noise, failed, errors_seen, detail = [], 0, {}, []
        for trial in range(cfg.failover_trials):
            leader = self.settle(ctl, [1, 2, 3], "before a failover trial")["leader"]
            follower, other = [i for i in (1, 2, 3) if i != leader]
            w = self.put_loop(pl, three, follower, f"{pl.name}-fo{trial}-{os.getpid()}")
            try:
                ctl.send(json.dumps({"cmd": "watch", "old": leader, "nodes": [follower, other],
                                     "limit_s": 30}))
                ctl.expect("WATCHING", 10)
                time.sleep(0.5)  # steady puts before the crash
                with Noise(noise):
                    t_kill = PROCS.kill(three[leader - 1].process)
                    seen = ctl.expect("RESULT", 60)["seen"]
                    out = self.end_put_loop(w, t_kill)
            except BaseException:
                PROCS.stop(w.p)
                raise
            rows["failover_new_leader"].append(None if seen is None else
                                               (seen["t"] - t_kill) * 1e3)
            rows["failover_first_put"].append(None if out["first_ok_s"] is None else
                                              out["first_ok_s"] * 1e3)
            rows["failover_put_gap"].append(None if out["max_gap_s"] is None else
                                            out["max_gap_s"] * 1e3)
            failed += out["failed"]
            for code, count in out["errors_after"].items():
                errors_seen[code] = errors_seen.get(code, 0) + count
            t0 = time.monotonic()
            startup = relaunch_mooncaked(three[leader - 1])
            self.settle(ctl, [1, 2, 3], f"restarting node{leader}")
            rows["failover_restart"].append((time.monotonic() - t0) * 1e3)
            detail.append({"killed": leader, "puts_through": follower,
                           "new_leader": seen, "put_loop": out, "restart_ready_s": startup})
            b.log(f"[{pl.name}] failover trial {trial}: killed node{leader}; new leader "
                  f"{seen and seen['leader']} after "
                  f"{report.fmt(rows['failover_new_leader'][-1])} ms, first put after "
                  f"{report.fmt(rows['failover_first_put'][-1])} ms")
        transfer_noise = []
        for trial in range(cfg.failover_trials):
            leader = self.settle(ctl, [1, 2, 3], "before a transfer trial")["leader"]
            target, follower = sorted(i for i in (1, 2, 3) if i != leader)
            if trial % 2:
                target, follower = follower, target
            w = self.put_loop(pl, three, follower, f"{pl.name}-tl{trial}-{os.getpid()}")
            try:
                time.sleep(0.5)
                with Noise(transfer_noise):
                    got = self.command(ctl, cmd="transfer", to=target, via=leader,
                                       nodes=[follower, target], limit_s=30)
                    out = self.end_put_loop(w, got["t0"])
            except BaseException:
                PROCS.stop(w.p)
                raise
            if got["error"]:
                self.b.info["errors"].append(f"cluster transfer-leader [{pl.name}]: "
                                             f"{got['error']}")
            rows["transfer_return"].append((got["t_return"] - got["t0"]) * 1e3)
            rows["transfer_new_leader"].append(None if got["seen"] is None else
                                               (got["seen"]["t"] - got["t0"]) * 1e3)
            rows["transfer_first_put"].append(None if out["first_ok_s"] is None else
                                              out["first_ok_s"] * 1e3)
            rows["transfer_put_gap"].append(None if out["max_gap_s"] is None else
                                            out["max_gap_s"] * 1e3)
            failed += out["failed"]
            for code, count in out["errors_after"].items():
                errors_seen[code] = errors_seen.get(code, 0) + count
            detail.append({"transfer_from": leader, "to": target, "puts_through": follower,
                           "ctl": got, "put_loop": out})
        self.info.setdefault("failover", {})[pl.name] = {"trials": detail,
                                                          "put_errors_seen": errors_seen}
        notes = {
            "failover_new_leader": "kill -9 of the leader -> first cluster_status of a survivor "
                                   "naming another leader (polled every 5 ms)",
            "failover_first_put": "kill -9 of the leader -> end of the first put started after "
                                  "it that succeeded (4 KiB, through a follower, replica on "
                                  "that follower)",
            "failover_put_gap": "longest time between two successful puts around the kill",
            "failover_restart": "restart of the killed node (same config and Raft log) -> "
                                "cluster settled again (all up, followers applied)",
            "transfer_return": "cluster_transfer_leader call (sent to the leader) -> its answer",
            "transfer_new_leader": "transfer call -> a node reports the target as leader",
            "transfer_first_put": "transfer call -> end of the first put started after it that "
                                  "succeeded (through the third node)",
            "transfer_put_gap": "longest time between two successful puts around the transfer",
        }
        for op, values in rows.items():
            self.res.add(pl.name, "mcd-3node", op, None, "ms", values,
                         noise=transfer_noise if op.startswith("transfer") else noise,
                         n=len(values), note=notes[op])
        self.info["failover"][pl.name]["failed_puts"] = failed


def config_defaults(cfg) -> None:
    """The cluster section's counts (run.py's Config calls this)."""
    cfg.cluster_fsync = "batch"
    cfg.cluster_rate_s = 1.0
    cfg.cluster_segment = GiB  # the cross-node objects (~0.6 GiB) live on one node's segment
    cfg.cluster_small_segment = 256 * MiB
    cfg.cluster_batch_mooncake_segment = 768 * MiB  # ~100k keys/s x 4 KiB x 1 s, doubled
    cfg.cross_sizes = [(MiB, 200), (16 * MiB, 24)]
    cfg.failover_trials = cfg.trials
    if cfg.quick:
        cfg.cluster_rate_s = 0.3
        cfg.cluster_segment = 256 * MiB
        cfg.cross_sizes = [(MiB, 16), (16 * MiB, 4)]

