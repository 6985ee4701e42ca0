"""Hosts on one network, made of Linux network namespaces, and the faults between them.

Each host is a namespace `lgw<id>-<name>` with one veth pair: `eth0` inside at
198.18.S.N/24, the other end (`lgw<id>-<name>`) on the bridge `lgw<id>-br`, which has
198.18.S.1 in the root namespace, where the test process is the clients and the observer.
S is a /24 of the benchmarking range 198.18.0.0/15 no other run uses, so two runs on one
machine do not share a subnet. There is no default route anywhere: nothing routes out.

Faults:
- cut(a, b): packets between a and b are dropped, silently, as by a dead switch port: an
  nftables rule on each host's input drops the other's address (a drop on output would
  fail the sender's syscall at once, which no real partition does). oneway: a→b only.
- split(side, other) / join(side, other): every pair across two groups at once.
- link_down(host): the host's cable pulled (its veth down); link_up puts it back.
- slow(host, rate): a token bucket (tc tbf) each way on the host's veth pair.

Every run writes its pid into /run/llmgw-partition/<id>.pid before it makes anything;
at start a run removes what runs whose pid is dead (or that wrote none) left behind.
"""

import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "lgw"  # every namespace and link a run makes starts with it
MARKERS = Path("/run/llmgw-partition")
NFT_TABLE = """
table inet lgw {
  set drop_from { type ipv4_addr; }
  chain input { type filter hook input priority 0; policy accept; ip saddr @drop_from drop; }
}
"""


class NetError(Exception):
    """A command that builds or breaks the network failed."""


def sh(*argv: str, input: str | None = None, check: bool = True) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and r.returncode != 0:
        raise NetError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def missing_tools() -> str:
    """Why this machine cannot build hosts ('' if it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"`{tool}` is not installed (apt-get install iproute2 nftables)"
    return ""


@dataclass
class Host:
    name: str
    ns: str  # its network namespace
    addr: str  # its address on the bridge
    veth: str  # the root namespace's end of its cable

    def exec(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]


class Network:
    def __init__(self):
        sweep()
        MARKERS.mkdir(parents=True, exist_ok=True)
        self.id = secrets.token_hex(2)
        self.marker = MARKERS / f"{self.id}.pid"
        self.marker.write_text(f"{os.getpid()}\n")
        self.subnet = _free_subnet()
        self.bridge = f"{PREFIX}{self.id}-br"
        self.addr = f"{self.subnet}.1"
        self.hosts: dict[str, Host] = {}
        self._cuts: set[tuple[str, str]] = set()  # (from, to) pairs dropped
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.addr}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        """A host on the bridge with the next address. `name`: at most 7 characters
        (interface names are at most 15)."""
        if len(name) > 7 or not name.isalnum():
            raise NetError(f"host name {name!r}: at most 7 letters and digits")
        host = Host(
            name,
            f"{PREFIX}{self.id}-{name}",
            f"{self.subnet}.{len(self.hosts) + 2}",
            f"{PREFIX}{self.id}-{name}",
        )
        sh("ip", "netns", "add", host.ns)
        self.hosts[name] = host
        sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
           "netns", host.ns)  # fmt: skip
        sh("ip", "link", "set", host.veth, "master", self.bridge, "up")
        sh("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
        sh("ip", "-n", host.ns, "link", "set", "lo", "up")
        sh(*host.exec(["nft", "-f", "-"]), input=NFT_TABLE)
        return host

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # -- faults ----------------------------------------------------------------------------

    def cut(self, a: str, b: str, oneway: bool = False) -> None:
        """Drop what a sends b (and, unless `oneway`, what b sends a)."""
        for src, dst in [(a, b)] if oneway else [(a, b), (b, a)]:
            if (src, dst) not in self._cuts:
                self._drop(dst, src, "add")
                self._cuts.add((src, dst))

    def heal(self, a: str, b: str, oneway: bool = False) -> None:
        for src, dst in [(a, b)] if oneway else [(a, b), (b, a)]:
            if (src, dst) in self._cuts:
                self._drop(dst, src, "delete")
                self._cuts.discard((src, dst))

    def split(self, side: tuple[str, ...], other: tuple[str, ...]) -> None:
        """Cut every host of `side` from every host of `other`, as a broken link between
        two switches would: one nftables command per host."""
        self._between(other, side, "add")
        self._between(side, other, "add")

    def join(self, side: tuple[str, ...], other: tuple[str, ...]) -> None:
        """Heal a split so that each host of `side` gets every path back at once, as when
        the link between the switches comes back: first `other` hears `side` again, then
        each host of `side` hears all of `other` in one command. Healed pair by pair, a
        router that heard a scheduler again got a routing table with engines it could not
        reach yet, which no real link does."""
        self._between(other, side, "delete")
        self._between(side, other, "delete")

    def _between(self, hosts: tuple[str, ...], sources: tuple[str, ...], verb: str) -> None:
        for at in hosts:
            todo = [src for src in sources if ((src, at) in self._cuts) == (verb == "delete")]
            if not todo:
                continue
            addrs = ", ".join(self.addr if src == "client" else self.hosts[src].addr
                              for src in todo)  # fmt: skip
            sh(*self.hosts[at].exec(["nft", verb, "element", "inet", "lgw", "drop_from",
                                     f"{{ {addrs} }}"]))  # fmt: skip
            for src in todo:
                (self._cuts.add if verb == "add" else self._cuts.discard)((src, at))

    def heal_all(self) -> None:
        for src, dst in list(self._cuts):
            self.heal(src, dst, oneway=True)

    def _drop(self, at: str, source: str, verb: str) -> None:
        addr = self.addr if source == "client" else self.hosts[source].addr
        sh(*self.hosts[at].exec(["nft", verb, "element", "inet", "lgw", "drop_from",
                                 f"{{ {addr} }}"]))  # fmt: skip

    def link_down(self, host: str) -> None:
        sh("ip", "link", "set", self.hosts[host].veth, "down")

    def link_up(self, host: str) -> None:
        sh("ip", "link", "set", self.hosts[host].veth, "up")

    def slow(self, host: str, rate: str = "20mbit") -> None:
        """Both ways through the host's cable at most `rate`: the root end's egress is what
        the host downloads, its own eth0's egress what it uploads."""
        h = self.hosts[host]
        tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "400ms"]
        sh("tc", "qdisc", "replace", "dev", h.veth, "root", *tbf)
        sh("ip", "netns", "exec", h.ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf)

    def unslow(self, host: str) -> None:
        h = self.hosts[host]
        sh("tc", "qdisc", "del", "dev", h.veth, "root", check=False)
        sh("ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    # -- cleanup ---------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every namespace and link this run made (nft tables go with their
        namespace; a veth goes with either end)."""
        remove(self.id)


def remove(run_id: str) -> None:
    tag = f"{PREFIX}{run_id}-"
    for ns in _namespaces():
        if ns.startswith(tag):
            sh("ip", "netns", "del", ns, check=False)
    for link in _links():
        if link.startswith(tag):
            sh("ip", "link", "del", link, check=False)
    (MARKERS / f"{run_id}.pid").unlink(missing_ok=True)


def sweep() -> None:
    """Remove what earlier runs left, unless the run that made it is still alive."""
    ids = {n[len(PREFIX) :].split("-", 1)[0] for n in _namespaces() + _links()
           if n.startswith(PREFIX) and "-" in n}  # fmt: skip
    ids |= {p.stem for p in MARKERS.glob("*.pid")} if MARKERS.exists() else set()
    for run_id in ids:
        if not _alive(MARKERS / f"{run_id}.pid"):
            remove(run_id)


def _alive(marker: Path) -> bool:
    try:
        os.kill(int(marker.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def _links() -> list[str]:
    out = []
    for line in sh("ip", "-o", "link", "show").splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        out.append(name)
    return out


def _free_subnet() -> str:
    """A 198.18.S or 198.19.S prefix that no address of this machine is in."""
    taken = sh("ip", "-4", "-o", "addr", "show")
    for _ in range(200):
        s = secrets.randbelow(512)
        prefix = f"198.{18 + s // 256}.{s % 256}"
        if f" {prefix}." not in taken:
            return prefix
    raise NetError("no free /24 in 198.18.0.0/15")
