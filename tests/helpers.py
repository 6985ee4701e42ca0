"""Helpers every test may use: waiting with a deadline, ports, and real subprocesses."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from llmgw_agentd.process import port_free

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def eventually(cond, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll `cond()` until it returns something truthy; return that. Fail at the deadline."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            value = cond()
            if value:
                return value
        except Exception as e:  # the thing may not be up yet
            last_exc = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from last_exc
        time.sleep(interval)


# Ports handed out below the kernel's ephemeral range (32768-60999): a port the kernel
# picks with bind(0) is also what it gives the next outgoing connection, and on a loaded
# CI machine one took a test's port between free_port() and the server's bind
# ("Address already in use"). Never the same port twice in one run, either.
_PORTS = random.Random()
_GIVEN: set[int] = set()
_RANGES = (10_000, 20_000)  # free_range's ports; free_port's are 20000-32000
_range_next = _RANGES[0] + _PORTS.randrange(0, 9_000)  # apart from another session's


def free_port() -> int:
    """A loopback port nothing listens on now, for a server a test starts."""
    for _ in range(10_000):
        port = _PORTS.randint(20_000, 32_000)
        if port in _GIVEN or not port_free(port):
            continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free loopback port between 20000 and 32000")


def free_range(n: int = 21) -> tuple[int, int]:
    """`n` consecutive free ports (an agent's engine range), none handed out again.

    Ranges come from 10000-19999, apart from free_port's single ports (20000-32000):
    picked among those, a whole session's scattered singles left ever fewer gaps of 21
    and a late test could find none (seen in CI). Each port is checked bindable."""
    global _range_next
    tries = 0
    while tries < (_RANGES[1] - _RANGES[0]) // n:
        tries += 1
        lo = _range_next
        _range_next = lo + n if lo + 2 * n <= _RANGES[1] else _RANGES[0]
        block = range(lo, lo + n)
        if any(p in _GIVEN or not port_free(p) for p in block):
            continue
        _GIVEN.update(block)
        return lo, lo + n - 1
    raise RuntimeError(f"no {n} free consecutive loopback ports")


class Proc:
    """A real executable run on loopback, its stderr kept in a file for the test to read."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None, health: str = ""):
        self.argv = argv
        self.log_path = log
        self.health = health
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self._log = open(log, "wb")
        self.p = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 20.0, ok=(200,)) -> None:
        def up():
            if self.p.poll() is not None:
                return True  # no use waiting: said below
            try:
                return requests.get(self.health, timeout=1).status_code in ok
            except requests.ConnectionError:
                return False

        try:
            eventually(up, timeout, what=f"{self.health} to answer")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- log ---\n{self.log()}") from None
        if self.p.poll() is not None:
            self._log.close()  # nobody will stop() it
            raise AssertionError(f"{self.argv[0]} exited {self.p.returncode}:\n{self.log()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self._log.close()
        return self.p.returncode


def start_fake_engine(tmp: Path, key: str | None = None, name: str = "fake") -> tuple[Proc, str]:
    port = free_port()
    argv = [
        sys.executable,
        str(ROOT / "tests" / "fake_engine.py"),
        "--port",
        str(port),
        "--name",
        name,
    ]
    if key:
        argv += ["--key", key]
    url = f"http://127.0.0.1:{port}"
    proc = Proc(argv, tmp / f"engine-{name}-{port}.log", health=f"{url}/health")
    proc.wait_healthy()
    return proc, url


def start_router(tmp: Path, config: str, env: dict | None = None, wait: bool = True):
    """Start llmgw-router with `config` (TOML text; `{port}` is filled in). -> (proc, url)

    A config without [paths] gets a state directory of its own, so each router has its
    own usage spool and none touches /var/lib/llmgw."""
    port = free_port()
    cfg = tmp / f"router-{port}.toml"
    text = config.replace("{port}", str(port))
    if "[paths]" not in text:
        text += f'\n[paths]\nstate_dir = "{tmp / f"router-{port}-state"}"\n'
    cfg.write_text(text)
    proc = Proc(
        [str(BIN / "llmgw-router"), "--config", str(cfg)],
        tmp / f"router-{port}.log",
        env=env,
        health=f"http://127.0.0.1:{port}/ready",
    )
    if wait:
        proc.wait_healthy()
    return proc, f"http://127.0.0.1:{port}"


def llmgw(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run the `llmgw` CLI."""
    result = subprocess.run(
        [str(BIN / "llmgw"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"llmgw {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


def unit_service(unit: str) -> dict[str, list[str]]:
    """Every KEY=VALUE of systemd/UNIT's [Service] section, repeated keys kept in order."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in (ROOT / "systemd" / unit).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out
