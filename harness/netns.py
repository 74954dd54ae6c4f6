"""An emulated wide-area network: one Linux network namespace per replica behind a shaped link.

    hub namespace  <prefix>-hub:  bridge br0 --- h0 --- h1 ...  (tbf on every h<i>: hub -> replica i)
                                               |       |
    replica i      <prefix>-r<i>:             eth0    eth0     (tbf on eth0: replica i -> hub)
                                          198.18.0.1  198.18.0.2 ...

Each replica's veth pair is its slow link, shaped in both directions by a token-bucket filter
(``tc qdisc replace ... tbf``), so it is a full-duplex link of the given rate; traffic between the
ranks of one replica stays inside its namespace (loopback, unshaped). Addresses come from
198.18.0.0/15 (reserved for benchmarking) and exist only inside these namespaces; nothing is added
to the root namespace. This kernel has no ``netem``: no latency, jitter or loss is emulated.

Command generation is pure (``setup_commands``, ``shape_commands``, ``teardown_commands``) and
unit-tested; :func:`emulated_wan` runs them, and always tears the namespaces down (by name).
Needs root and iproute2 (``ip``, ``tc``): :func:`check_requirements`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator


@dataclasses.dataclass(frozen=True)
class WanTopology:
    """Names and addresses of the emulated network (nothing here touches the system)."""

    replicas: int = 2
    """Namespaces, one per replica (cluster); the ranks of a replica share its namespace."""
    prefix: str = "wanb"
    """Namespace name prefix: ``<prefix>-hub``, ``<prefix>-r0`` ... (teardown deletes these names)."""
    subnet: str = "198.18.0"
    """First three octets of the replicas' /24 (198.18.0.0/15 is the benchmarking range)."""
    iface: str = "eth0"
    """Name of the slow link's interface inside every replica namespace (``GLOO_SOCKET_IFNAME``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 250:
            raise ValueError(f"replicas must be in [1, 250], got {self.replicas}")
        if len(self.hub) > 30 or not self.prefix.replace("-", "").isalnum():
            raise ValueError(f"bad namespace prefix {self.prefix!r}")

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, replica: int) -> str:
        return f"{self.prefix}-r{replica}"

    def address(self, replica: int) -> str:
        return f"{self.subnet}.{replica + 1}"

    def hub_port(self, replica: int) -> str:
        return f"h{replica}"

    @property
    def namespaces(self) -> list[str]:
        return [self.hub] + [self.namespace(r) for r in range(self.replicas)]


def tbf_burst(rate_mbps: float) -> str:
    """Token-bucket depth: 256 KiB from 1 Gbit/s up, 64 KiB below (measured on these machines to
    reach the ring all-reduce formula within a few percent; a bucket too small for the rate's timer
    granularity caps the rate below the setting)."""
    return "256kb" if rate_mbps >= 1000 else "64kb"


def netns_exec(namespace: str, argv: list[str]) -> list[str]:
    """``argv`` run inside ``namespace`` (``ip netns exec`` also mounts the namespace's sysfs)."""
    return ["ip", "netns", "exec", namespace, *argv]


def setup_commands(topo: WanTopology) -> list[list[str]]:
    """Create the namespaces, the bridge and one veth pair per replica (unshaped, all up)."""
    cmds = [["ip", "netns", "add", ns] for ns in topo.namespaces]
    cmds += [["ip", "-n", topo.hub, "link", "add", "br0", "type", "bridge"],
             ["ip", "-n", topo.hub, "link", "set", "br0", "up"],
             ["ip", "-n", topo.hub, "link", "set", "lo", "up"]]
    for r in range(topo.replicas):
        ns, port = topo.namespace(r), topo.hub_port(r)
        cmds += [
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            # both ends are created in their namespaces directly: nothing appears in the root one
            ["ip", "-n", ns, "link", "add", topo.iface, "type", "veth", "peer", "name", port,
             "netns", topo.hub],
            ["ip", "-n", topo.hub, "link", "set", port, "master", "br0"],
            ["ip", "-n", topo.hub, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{topo.address(r)}/24", "dev", topo.iface],
            ["ip", "-n", ns, "link", "set", topo.iface, "up"],
        ]
    return cmds


def shape_commands(topo: WanTopology, rate_mbps: float, latency_ms: float = 5.0) -> list[list[str]]:
    """Set every replica's link to ``rate_mbps`` in both directions (``tc qdisc replace``: also
    changes the rate of an already shaped link). ``latency_ms`` is tbf's queue bound, not a delay."""
    if rate_mbps <= 0:
        raise ValueError(f"link rate must be positive, got {rate_mbps} Mbit/s")
    rate = f"{rate_mbps:g}mbit"
    tbf = ["root", "tbf", "rate", rate, "burst", tbf_burst(rate_mbps), "latency", f"{latency_ms:g}ms"]
    cmds = []
    for r in range(topo.replicas):
        cmds.append(netns_exec(topo.namespace(r), ["tc", "qdisc", "replace", "dev", topo.iface, *tbf]))
        cmds.append(netns_exec(topo.hub, ["tc", "qdisc", "replace", "dev", topo.hub_port(r), *tbf]))
    return cmds


def teardown_commands(topo: WanTopology) -> list[list[str]]:
    """Delete the namespaces by name (their veth pairs, bridge and qdiscs go with them)."""
    return [["ip", "netns", "del", ns] for ns in reversed(topo.namespaces)]


def existing_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def check_requirements(install: bool = True, log: Callable[[str], None] = print) -> None:
    """Exit with a clear message unless this process is root and iproute2 is usable.

    Without ``ip``/``tc`` and with ``install``, installs iproute2 with apt-get (root only)."""
    if os.geteuid() != 0:
        raise SystemExit("bench-wan: needs root (it creates network namespaces, veth pairs and tc "
                         "qdiscs); run it as root, e.g. `sudo make bench-wan`")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing and install and shutil.which("apt-get"):
        log(f"bench-wan: {', '.join(missing)} not found; installing iproute2 with apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "iproute2"], env=env, check=False)
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"bench-wan: needs iproute2 ({', '.join(missing)} not found); install it, "
                         "e.g. `apt-get install -y iproute2`")


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        hint = ""
        if "tbf" in cmd and ("Unknown qdisc" in proc.stderr or "No such file" in proc.stderr):
            hint = " (the kernel lacks the tbf qdisc, sch_tbf)"
        elif cmd[:3] == ["ip", "netns", "add"]:
            hint = " (network namespaces unavailable: needs CAP_SYS_ADMIN and CONFIG_NET_NS)"
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}{hint}")
    return proc


def teardown(topo: WanTopology) -> list[str]:
    """Delete this topology's namespaces that exist; returns the names still present (should be none)."""
    present = existing_namespaces()
    for cmd in teardown_commands(topo):
        if cmd[-1] in present:
            _run(cmd, check=False)
    return sorted(existing_namespaces() & set(topo.namespaces))


def shape(topo: WanTopology, rate_mbps: float) -> None:
    for cmd in shape_commands(topo, rate_mbps):
        _run(cmd)


@contextlib.contextmanager
def emulated_wan(topo: WanTopology, log: Callable[[str], None] = print) -> Iterator[WanTopology]:
    """Set up the namespaces (removing leftovers of the same names first), yield, and always tear
    them down, also on an exception or KeyboardInterrupt. The caller must have ended every process
    it started inside them (a process keeps its namespace alive after the name is deleted)."""
    stale = teardown(topo)
    if stale:
        raise RuntimeError(f"could not delete leftover namespaces {stale}")
    try:
        for cmd in setup_commands(topo):
            _run(cmd)
        log(f"bench-wan: namespaces {', '.join(topo.namespaces)} up ({topo.replicas} replicas, "
            f"{topo.subnet}.0/24 on {topo.iface})")
        yield topo
    finally:
        left = teardown(topo)
        if left:
            print(f"bench-wan: WARNING: namespaces {left} still exist; delete them with "
                  f"`ip netns del NAME`", file=sys.stderr)
        else:
            log(f"bench-wan: namespaces {', '.join(topo.namespaces)} deleted")


GOODPUT_SCRIPT = r"""
import socket, sys, time
role, host, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "server":
    s = socket.create_server((host, port)); s.settimeout(120)
    print("ready", flush=True)
    c, _ = s.accept(); got = 0; t0 = None
    while got < nbytes:
        b = c.recv(1 << 20)
        if not b: break
        if t0 is None: t0 = time.perf_counter()
        got += len(b)
    print(f"{got} {time.perf_counter() - t0:.6f}", flush=True); c.sendall(b"k"); c.close()
else:
    c = socket.create_connection((host, port), timeout=120); buf = bytes(1 << 20); left = nbytes
    while left > 0:
        n = c.send(buf[:min(left, len(buf))]); left -= n
    c.recv(1)
"""


def measure_goodput(topo: WanTopology, nbytes: int, port: int = 5199) -> float:
    """TCP payload rate in Mbit/s from replica 1 to replica 0 (one stream of ``nbytes``): a check
    that the shaping is in place (expect about 95.6% of the link rate, the TCP payload share)."""
    server = subprocess.Popen(netns_exec(topo.namespace(0), [sys.executable, "-c", GOODPUT_SCRIPT, "server",
                                                             topo.address(0), str(port), str(nbytes)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("goodput server did not start")
        _run(netns_exec(topo.namespace(1), [sys.executable, "-c", GOODPUT_SCRIPT, "client",
                                            topo.address(0), str(port), str(nbytes)]))
        got, seconds = server.stdout.readline().split()
        server.wait(timeout=30)
        return int(got) * 8 / float(seconds) / 1e6
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
