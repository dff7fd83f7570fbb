"""A private network for a local swarm: one Linux network namespace per node (``ddiloco chaos --netns``).

    hub namespace: bridge br0 (and br1, the far side of a partition)
      h0 <-veth-> eth0 in node namespace 0 (10.201.0.1/24, lo up)
      h1 <-veth-> eth0 in node namespace 1 (10.201.0.2/24)
      ...

Every link and address lives in namespaces made here (names ``ddc<tag>-...``); the host's own interfaces,
routes and firewall are never touched, and nothing a node sends can leave them. A node's link may be capped
with a token bucket (``tc tbf``, both directions: egress of eth0 is its upload, egress of its hub port its
download). A partition moves some nodes' hub ports onto the second bridge; healing moves them back.

``netem`` is not available, so a round trip (``rtt_ms``) is added in user space, at the IP layer: the hub
routes instead of bridging (a /32 route and proxy ARP per port, the hub at ``10.201.0.254``), a policy rule
sends every packet that comes in on a hub port into a TUN device, and a delay line holding that device
(``node.chaos.delay``) writes each packet back half the round trip later, to be routed on to its destination.
Every protocol crosses it alike (libp2p, the DHT, gloo), and nodes keep their own addresses.

The harness reaches a node's status endpoint (loopback inside the node's namespace) from a short-lived
thread that enters that namespace (``setns``), so no link joins the host either. ``close()`` deletes the namespaces (after their processes are gone); it runs on exit
and on Ctrl+C. Needs root and iproute2.

With ``cpu`` > 0 each node also gets a CPU quota of its own (a cgroup-v1 ``cpu`` group ``ddc<tag>-n<i>``,
``cfs_quota_us`` = cpu x the period), which its process tree (DHT process and p2pd included) joins before
the node starts. Nodes sharing one machine then behave like nodes on hosts of their own: a node that waits
on the network leaves its share idle instead of lending it to the others.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from node.local.launcher import Child, private_tmp
from protocol.errors import ConfigError, DDiLoCoError

T = TypeVar("T")
logger = logging.getLogger(__name__)
CLONE_NEWNET = 0x40000000
SUBNET = "10.201.0"
HUB_ADDR = f"{SUBNET}.254"  # the hub's own address when it routes (``rtt_ms``)
DELAY_TABLE = "100"  # the routing table that sends what comes in on a hub port into the delay line
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (``cpu.cfs_quota_us``)


class NetnsError(DDiLoCoError):
    """A namespace, link or qdisc could not be made; the message has the command and its error."""


def _run(cmd: list[str], hint: str = "") -> None:
    """``cmd``, or NetnsError with the command, its error and ``hint``."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(cmd)}: {e}") from e
    if out.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed: {out.stderr.strip()}{hint}")


def _ip(*args: str) -> None:
    _run(["ip", *args], " (needs root and iproute2)")


def _tc(ns: str, *args: str) -> None:
    _run(["tc", "-n", ns, *args])


class NetLab:
    def __init__(
        self,
        nodes: int,
        rate: str = "",
        tag: str = "",
        burst: str = "32kbit",
        cpu: float = 0.0,
        rtt_ms: float = 0.0,
    ) -> None:
        """``burst``: the token bucket's depth. 32kbit holds rates up to ~100mbit here; a faster cap needs
        about 1 ms of its rate (a 4 KB bucket lets 1000mbit through at ~400 Mbit/s on this machine).
        ``cpu``: CPU cores each node may use (0: no quota). ``rtt_ms``: a round trip added between every two
        nodes, by a delay line in the hub that holds each packet half of it (``node.chaos.delay``)."""
        if os.geteuid() != 0:
            raise ConfigError("--netns needs root (it creates network namespaces); run without it otherwise")
        if not 1 <= nodes <= 250:
            raise ConfigError(f"nodes={nodes} is invalid for --netns: 1 to 250")
        if not 0 <= rtt_ms <= 10_000:
            raise ConfigError(f"rtt_ms={rtt_ms:g} is invalid: 0 to 10000 ms")
        if cpu < 0 or cpu > (os.cpu_count() or 1):
            raise ConfigError(f"cpu={cpu:g} is invalid: cores per node, 0 (no quota) to {os.cpu_count()}")
        if cpu and not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
            raise ConfigError(f"a CPU quota per node needs cgroup v1's cpu controller at {CPU_CGROUPS}")
        self.nodes, self.rate, self.burst, self.cpu, self.rtt_ms = nodes, rate, burst, cpu, rtt_ms
        self.delay_line: subprocess.Popen | None = None
        self.groups: list[Path] = []
        self.tag = tag or str(os.getpid() % 100000)
        self.hub = f"ddc{self.tag}-hub"
        self.made: list[str] = []
        self.split: set[int] = set()
        self._libc = ctypes.CDLL(None, use_errno=True)

    def ns(self, i: int) -> str:
        return f"ddc{self.tag}-n{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def open(self) -> NetLab:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        _ip("netns", "add", self.hub)
        self.made.append(self.hub)
        if self.rtt_ms:
            self._route_in_hub()
        for br in () if self.rtt_ms else ("br0", "br1"):  # a routing hub bridges nothing
            _ip("-n", self.hub, "link", "add", br, "type", "bridge")
            _ip("-n", self.hub, "link", "set", br, "up")
        for i in range(self.nodes):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            tmp = f"ddc{self.tag}x"  # made straight in the node's namespace; the name never shows on the host
            _ip("link", "add", tmp, "netns", ns, "type", "veth", "peer", "name", f"h{i}", "netns", self.hub)
            _ip("-n", ns, "link", "set", tmp, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if self.rtt_ms:
                self._route_port(i)
            else:
                _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"h{i}", "up")
            if self.rate:
                for where, dev in ((ns, "eth0"), (self.hub, f"h{i}")):
                    _tc(where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.burst,
                        "latency", "50ms")  # fmt: skip
            if self.cpu:
                group = CPU_CGROUPS / ns
                group.mkdir()
                self.groups.append(group)
                period = int((group / "cpu.cfs_period_us").read_text())
                (group / "cpu.cfs_quota_us").write_text(str(int(self.cpu * period)))
        if self.rtt_ms:
            self._start_delay()

    def _sysctl(self, *settings: str) -> None:
        """Kernel settings of the hub namespace (``net.*`` is per namespace)."""
        _run(["ip", "netns", "exec", self.hub, "sysctl", "-qw", *settings])

    def _route_in_hub(self) -> None:
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "addr", "add", f"{HUB_ADDR}/32", "dev", "lo")
        self._sysctl(
            "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"
        )

    def _route_port(self, i: int) -> None:
        """Node ``i``'s hub port as a routed link: the hub answers its ARP for the other nodes (at once, not
        after proxy ARP's default random wait), reaches it by a /32, and sends what it sends to the delay."""
        port = f"h{i}"
        self._sysctl(f"net.ipv4.conf.{port}.proxy_arp=1", f"net.ipv4.neigh.{port}.proxy_delay=0",
                     f"net.ipv4.conf.{port}.rp_filter=0")  # fmt: skip
        _ip("-n", self.hub, "link", "set", port, "up")
        _ip("-n", self.hub, "route", "add", f"{self.addr(i)}/32", "dev", port, "src", HUB_ADDR)
        _ip("-n", self.hub, "rule", "add", "iif", port, "lookup", DELAY_TABLE)

    def _start_delay(self) -> None:
        cmd = ["ip", "netns", "exec", self.hub, sys.executable, "-m", "node.chaos.delay"]
        cmd += ["--one-way-ms", f"{self.rtt_ms / 2:g}", "--dev", "tun0"]
        # only its first line is read: its output past that goes nowhere, so that no pipe fills
        self.delay_line = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.delay_line.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        if not box or "delaying" not in box[0]:
            raise NetnsError(f"the delay line did not start within 30 s: {box[0] if box else '(no output)'}")
        self._sysctl("net.ipv4.conf.tun0.rp_filter=0")
        _ip("-n", self.hub, "link", "set", "tun0", "up")
        _ip("-n", self.hub, "route", "add", "default", "dev", "tun0", "table", DELAY_TABLE)

    def close(self) -> None:
        if self.delay_line is not None:
            self.delay_line.terminate()
            try:
                self.delay_line.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.delay_line.kill()
                self.delay_line.wait(timeout=10)
            self.delay_line = None
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.made.clear()
        for group in reversed(
            self.groups
        ):  # empty once its processes are gone (a killed tree may take a moment)
            for attempt in range(50):
                try:
                    group.rmdir()
                    break
                except OSError as e:
                    if attempt == 49:
                        logger.warning("cgroup %s could not be removed: %s", group, e)
                    time.sleep(0.1)
        self.groups.clear()

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run in node ``i``'s namespace and, with a CPU quota, in its cgroup (a shell joins it and
        execs, so every process the node starts is in it too)."""
        cmd = ["ip", "netns", "exec", self.ns(i), *argv]
        if not self.cpu:
            return cmd
        procs = str(CPU_CGROUPS / self.ns(i) / "cgroup.procs")
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *cmd]

    # ------------------------------------------------------------------ nodes
    def node_flags(self, i: int) -> list[str]:
        return ["--host-maddrs", f"/ip4/{self.addr(i)}/tcp/0"]

    def start(self, index: int, run_dir: Path, flags: list[str], peers: list[str]) -> Child:
        """``node.local.launcher.start_node`` inside node ``index``'s namespace (``ip netns exec`` execs, so the
        process is the node itself, leading its own process group)."""
        d = run_dir / f"node-{index}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "ready.json").unlink(missing_ok=True)
        log = d / "node.log"
        cmd = [sys.executable, "-m", "node", "node"]
        cmd += ["--state-dir", str(d), "--exit-with-parent", *flags, *self.node_flags(index)]
        if peers:
            cmd += ["--initial-peers", ",".join(peers)]
        cmd = self.command(index, cmd)
        tmp = private_tmp(index)
        env = dict(os.environ, TMPDIR=tmp)
        if "--threads" in flags:
            env.setdefault("OMP_NUM_THREADS", flags[flags.index("--threads") + 1])
        with open(log, "ab") as fh:
            # its own process group, in this session: see ``node.local.launcher.start_node``
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, process_group=0, env=env)
        return Child(index, d, proc, log, tmp=tmp)

    def inside(self, i: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread that has entered node ``i``'s network namespace (sockets it opens live
        there); the thread ends with it, so no other thread changes namespace."""
        box: dict = {}

        def run() -> None:
            try:
                fd = os.open(f"/var/run/netns/{self.ns(i)}", os.O_RDONLY)
                try:
                    if self._libc.setns(fd, CLONE_NEWNET) != 0:
                        raise NetnsError(f"setns into {self.ns(i)}: {os.strerror(ctypes.get_errno())}")
                finally:
                    os.close(fd)
                box["v"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["e"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join()
        if "e" in box:
            raise box["e"]
        return box["v"]

    def link_bytes(self, i: int) -> tuple[int, int]:
        """Bytes node ``i`` has sent and received on its link so far (eth0's counters: every protocol and
        header that crossed it)."""
        c = self.link_counters(i)
        return c["tx_bytes"], c["rx_bytes"]

    def link_counters(self, i: int) -> dict[str, int]:
        """Node ``i``'s eth0 counters so far: bytes and packets each way (a packet's Ethernet, IP and TCP
        headers are in its bytes)."""
        cmd = ["ip", "-n", self.ns(i), "-s", "-j", "link", "show", "dev", "eth0"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        if out.returncode != 0:
            raise NetnsError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
        st = json.loads(out.stdout)[0]["stats64"]
        return {f"{way}_{what}": int(st[way][what]) for way in ("tx", "rx") for what in ("bytes", "packets")}

    def tcp_bytes(self, i: int) -> dict[str, int]:
        """Node ``i``'s TCP sockets on its link now, summed (``ss -ti``): the bytes its processes wrote and
        read (libp2p's framing and encryption included, TCP/IP headers not), the bytes sent again, and the segments. A closed
        socket's counts go with it, so differences over a window hold for the long-lived connections."""
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns(i),
            "ss",
            "-tinH",
            "src",
            self.addr(i),
            "and",
            "not",
            "dst",
            self.addr(i),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        if out.returncode != 0:
            raise NetnsError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
        tot = {
            "bytes_sent": 0,
            "bytes_retrans": 0,
            "bytes_received": 0,
            "segs_out": 0,
            "segs_in": 0,
            "sockets": 0,
        }
        for word in out.stdout.split():
            key, _, value = word.partition(":")
            if key in tot and value.isdigit():
                tot[key] += int(value)
        tot["sockets"] = sum(
            1 for line in out.stdout.splitlines() if line.startswith(("ESTAB", "CLOSE", "FIN"))
        )
        return tot

    # ------------------------------------------------------------------ faults
    def partition(self, side: set[int]) -> None:
        """Move ``side``'s hub ports to the second bridge: they reach each other, not the rest."""
        if self.rtt_ms:  # the hub routes then: there is no bridge to move a port to
            raise ConfigError("a partition with a round trip set (rtt_ms) is not supported")
        for i in side:
            _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br1")
        self.split = set(side)

    def heal(self) -> None:
        for i in sorted(self.split):
            _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")
        self.split = set()
