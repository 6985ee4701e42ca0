"""A real OpenSSH server on loopback for tests: its own host key, port and authorized
keys, and a client key and known_hosts file that trust only it (apt: openssh-server)."""

import os
import shutil
import subprocess
from pathlib import Path

from tests.helpers import Proc, eventually, free_port

SSHD = Path("/usr/sbin/sshd")


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


class Sshd:
    def __init__(self, tmp: Path):
        self.dir = tmp / "sshd"
        self.dir.mkdir()
        self.port = free_port()
        self.host_key = self.dir / "host_ed25519"
        self.key = self.dir / "client_ed25519"  # authorized
        self.other_key = self.dir / "other_ed25519"  # not authorized
        for k in (self.host_key, self.key, self.other_key):
            keygen(k)
        (self.dir / "authorized_keys").write_text((self.dir / "client_ed25519.pub").read_text())
        host_pub = (self.dir / "host_ed25519.pub").read_text().split()
        self.known_hosts = self.dir / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        config = self.dir / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.host_key}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            f"StrictModes no\nUsePAM no\nPidFile {self.dir / 'sshd.pid'}\n"
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation dir
        self.proc = Proc([str(SSHD), "-D", "-e", "-f", str(config)], self.dir / "sshd.log")
        eventually(self.answers, timeout=15, what="sshd to accept a login")

    @property
    def user(self) -> str:
        import getpass

        return getpass.getuser()

    @property
    def target(self) -> str:
        return f"{self.user}@127.0.0.1:{self.port}"

    def ssh_args(self) -> list[str]:
        """`llmgw nodes onboard` options that reach this server and trust only it."""
        return ["--ssh", self.target, "--identity", str(self.key),
                "-o", f"UserKnownHostsFile={self.known_hosts}"]  # fmt: skip

    def answers(self) -> bool:
        r = subprocess.run(
            ["ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
             "-i", str(self.key), "-p", str(self.port), f"{self.user}@127.0.0.1", "true"],
            capture_output=True, timeout=20,
        )  # fmt: skip
        return r.returncode == 0

    def stop(self) -> None:
        self.proc.stop()


def available() -> bool:
    return SSHD.exists() and shutil.which("ssh") is not None and os.geteuid() == 0
