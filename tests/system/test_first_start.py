"""Every tool's first start as its systemd unit runs it, on the install docs/install.md makes.

The directories are made by running the `install -d` lines of docs/install.md (paths
moved into a temporary tree); each tool then runs as the unprivileged `llmgw` user
under bubblewrap with what its unit file says: the root read-only (ProtectSystem=strict)
but for the unit's StateDirectory and ReadWritePaths, a private /tmp, hidden homes, the
unit's UMask, no network for PrivateNetwork and the kernel's MDWE where the unit sets
MemoryDenyWriteExecute. So the test fails when the documented ownership, a unit's
write paths and what the tool writes disagree.
"""

import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests

from tests.helpers import BIN, ROOT, eventually, free_port, unit_service

USER = "llmgw"
UNITS = ROOT / "systemd"
# The directories of a real install; the tree holds each under its own path.
INSTALLED = ("/etc/llmgw", "/var/lib/llmgw", "/var/backups/llmgw")
# Set the unit's umask and, for MemoryDenyWriteExecute, PR_SET_MDWE (65) with
# PR_MDWE_REFUSE_EXEC_GAIN (1), which the kernel keeps across exec; then run the tool.
LAUNCH = """
import ctypes, os, sys
umask, mdwe, *argv = sys.argv[1:]
os.umask(int(umask, 8))
if mdwe == "1" and ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) != 0:
    sys.exit("PR_SET_MDWE failed")
os.execv(argv[0], argv)
"""


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def missing(reason: str):
    if in_ci():
        pytest.fail(f"CI must run the first-start tests: {reason}")
    pytest.skip(reason)


service = unit_service  # one parser of the units, in tests/helpers.py


def one(settings: dict, key: str, default: str = "") -> str:
    return settings.get(key, [default])[-1]


class Tree:
    """A machine's llmgw directories under a temporary root, as docs/install.md makes them."""

    def __init__(self, root: Path, user: pwd.struct_passwd):
        self.root = root
        self.user = user
        self.config = self.at("/etc/llmgw/llmgw.toml")

    def at(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def moved(self, text: str) -> str:
        for path in INSTALLED:
            text = re.sub(rf"(?<![\w/]){re.escape(path)}(?=[/\s]|$)", str(self.at(path)), text)
        return text

    def install(self) -> None:
        """Run the `install -d` lines of docs/install.md, moved into the tree."""
        lines = [
            line.strip()
            for line in (ROOT / "docs" / "install.md").read_text().splitlines()
            if line.strip().startswith("install -d ")
        ]
        assert lines, "docs/install.md makes no directories with install -d"
        for line in lines:
            subprocess.run(shlex.split(self.moved(line)), check=True)

    def write_config(self, text: str) -> None:
        base = (
            f'[paths]\nconfig_dir = "{self.at("/etc/llmgw")}"\n'
            f'state_dir = "{self.at("/var/lib/llmgw")}"\n'
            f'backup_dir = "{self.at("/var/backups/llmgw")}"\n'
        )
        self.config.write_text(base + text)
        self.config.chmod(0o644)

    def exec_start(self, unit: str) -> list[str]:
        """The unit's ExecStart, with this checkout's executables and the tree's paths."""
        line = one(service(unit), "ExecStart").replace("/opt/llmgw/venv/bin/", f"{BIN}/")
        return shlex.split(self.moved(line))


class Sandbox:
    """Run a command as `unit` would: its user, its umask, its view of the file system."""

    def __init__(self, tree: Tree, unit: str):
        self.tree = tree
        self.unit = unit
        self.s = service(unit)

    def writable(self) -> list[tuple[Path, bool]]:
        """(path, required) the unit may write, mapped into the tree."""
        out = []
        for name in " ".join(self.s.get("StateDirectory", [])).split():
            state = self.tree.at(f"/var/lib/{name}")
            state.mkdir(parents=True, exist_ok=True)  # as systemd makes it, before the start
            os.chown(state, self.tree.user.pw_uid, self.tree.user.pw_gid)
            state.chmod(int(one(self.s, "StateDirectoryMode", "0755"), 8))
            out.append((state, True))
        for entry in " ".join(self.s.get("ReadWritePaths", [])).split():
            out.append((self.tree.at(entry.lstrip("-")), not entry.startswith("-")))
        return out

    def argv(self, command: list[str], status_fd: int) -> list[str]:
        s = self.s
        assert one(s, "User") == USER and one(s, "Group") == USER, f"{self.unit} runs as {USER}"
        assert one(s, "ProtectSystem") == "strict", f"{self.unit}: ProtectSystem=strict"
        argv = [
            "bwrap",
            "--json-status-fd",
            str(status_fd),
            "--ro-bind",
            "/",
            "/",
            "--proc",
            "/proc",
        ]
        argv += (
            ["--dev", "/dev"]
            if one(s, "PrivateDevices") == "true"
            else ["--dev-bind", "/dev", "/dev"]
        )
        if one(s, "PrivateNetwork") == "true":
            argv.append("--unshare-net")
        hidden = []
        if one(s, "PrivateTmp") == "true":
            argv += ["--perms", "1777", "--tmpfs", "/tmp"]
            hidden.append(Path("/tmp"))
        if one(s, "ProtectHome") == "true":
            for home in ("/home", "/root", "/run/user"):
                if os.path.isdir(home):
                    argv += ["--perms", "0755", "--tmpfs", home]
                    hidden.append(Path(home))
        # The unit runs /opt/llmgw/venv; this checkout, its interpreter and the tree may
        # lie under /tmp or a home, which the lines above hid: show them again, read-only,
        # through directories the service user may pass (bwrap would make them 0700).
        for path in sorted({ROOT, Path(sys.base_prefix).resolve(), self.tree.root}):
            under = next((h for h in hidden if path.is_relative_to(h)), None)
            if under is None:
                continue
            for parent in reversed(path.parents):
                if parent.is_relative_to(under) and parent != under:
                    argv += ["--perms", "0755", "--dir", str(parent)]
            argv += ["--ro-bind", str(path), str(path)]
        for path, required in self.writable():
            if not path.exists():
                assert not required, f"{self.unit} would not start: {path} does not exist"
                continue  # "-": systemd leaves out a path that is not there
            argv += ["--bind", str(path), str(path)]
        user = self.tree.user
        argv += ["--", "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}"]
        argv += ["--init-groups", str(BIN / "python"), "-c", LAUNCH]
        argv += [
            one(s, "UMask", "0022"),
            "1" if one(s, "MemoryDenyWriteExecute") == "true" else "0",
        ]
        return argv + command

    def env(self) -> dict:
        # What systemd gives a service: no inherited environment, HOME from passwd (mapped).
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.tree.at(self.tree.user.pw_dir)),
            "LANG": "C.UTF-8",
            "LLMGW_CONFIG": str(self.tree.config),
            "PYTHONUNBUFFERED": "1",
        }

    def run(
        self, command: list[str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run to completion (a oneshot unit, or a start that fails)."""
        r, w = os.pipe()
        try:
            return subprocess.run(
                self.argv(command or self.tree.exec_start(self.unit), w),
                capture_output=True,
                text=True,
                env=self.env(),
                pass_fds=(w,),
                timeout=timeout,
            )
        finally:
            os.close(r)
            os.close(w)

    def start(self, log: Path, command: list[str] | None = None) -> "Service":
        return Service(self, command or self.tree.exec_start(self.unit), log)


class Service:
    """A long-running unit's process in its sandbox; stop() signals the tool, not bwrap."""

    def __init__(self, sandbox: Sandbox, command: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "wb")
        self._status = tempfile.TemporaryFile()
        self.p = subprocess.Popen(
            sandbox.argv(command, self._status.fileno()),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=sandbox.env(),
            pass_fds=(self._status.fileno(),),
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, cond, what: str, timeout: float = 30) -> None:
        """Wait until cond() holds; fail at once, with the log, if the tool exits."""
        try:
            eventually(lambda: self.p.poll() is not None or cond(), timeout, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- log ---\n{self.log()}") from None
        if self.p.poll() is not None:
            raise AssertionError(f"exited {self.p.returncode}:\n{self.log()}")

    def child(self) -> int:
        self._status.seek(0)
        first = self._status.readline()
        return json.loads(first)["child-pid"] if first else 0

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to the tool, as systemd stops it; its exit status (bwrap passes it on)."""
        if self.p.poll() is None:
            pid = eventually(self.child, 10, what="bwrap to name the sandboxed process")
            os.kill(pid, signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self._log.close()
        self._status.close()
        return self.p.returncode


def service_user() -> pwd.struct_passwd:
    for tool in ("bwrap", "setpriv"):
        if shutil.which(tool) is None:
            missing(f"{tool} is missing: apt-get install bubblewrap util-linux")
    if os.geteuid() != 0:
        missing("only root can make the documented install and run a tool as llmgw")
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    # As docs/install.md makes it.
    subprocess.run(
        ["useradd", "--system", "--home", "/var/lib/llmgw", "--shell", "/usr/sbin/nologin", USER],
        check=True,
    )
    return pwd.getpwnam(USER)


@pytest.fixture
def tree():
    user = service_user()
    root = Path(tempfile.mkdtemp(prefix="llmgw-install-"))
    root.chmod(0o755)  # the service user must reach the directories inside
    t = Tree(root, user)
    try:
        probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "true"], capture_output=True)
        if probe.returncode != 0:
            missing(f"bwrap cannot make a sandbox here: {probe.stderr.decode().strip()}")
        t.install()
        yield t
    finally:
        shutil.rmtree(root, ignore_errors=True)


def scheduler_config(tree: Tree) -> dict:
    ports = {
        "bus": f"tcp://127.0.0.1:{free_port()}",
        "publish": f"tcp://127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "router": f"127.0.0.1:{free_port()}",
        "certmon": f"127.0.0.1:{free_port()}",
    }
    tree.write_config(
        f'[scheduler]\nbus = "{ports["bus"]}"\npublish = "{ports["publish"]}"\n'
        f'admin_listen = "{ports["admin"]}"\nmetrics_listen = ""\nsettle_s = 0.2\n'
        f'[agent]\nname = "gpu-01"\nschedulers = ["{ports["bus"]}"]\n'
        f'metrics_listen = "127.0.0.1:{free_port()}"\n'
        f'[router]\nlisten = "{ports["router"]}"\nbus_name = "router-1"\n'
        f'schedulers = ["{ports["publish"]}"]\nscheduler_bus = ["{ports["bus"]}"]\n'
        f'[certmon]\nlisten = "{ports["certmon"]}"\n'
    )
    return ports


def ctl(tree: Tree, *args: str) -> subprocess.CompletedProcess:
    """`llmgw` as the operator runs it on the control-plane machine: as root."""
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_STORE"}
    return subprocess.run(
        [str(BIN / "llmgw"), "--config", str(tree.config), *args],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )


def owned_by_llmgw(tree: Tree, path: Path, mode: int) -> bool:
    st = path.stat()
    return st.st_uid == tree.user.pw_uid and st.st_mode & 0o777 == mode


@pytest.fixture
def control_plane(tree, tmp_path):
    """The scheduler started once as its unit runs it, with a node and a router added."""
    ports = scheduler_config(tree)
    scheduler = Sandbox(tree, "llmgw-scheduler.service").start(tmp_path / "scheduler.log")

    def admin_up():
        return requests.get(f"http://{ports['admin']}/v1/nodes", timeout=1).status_code == 401

    try:
        scheduler.wait_for(admin_up, "the scheduler's admin API")
        ctl(tree, "nodes", "add", "gpu-01")
        ctl(tree, "routers", "add", "router-1")
        yield tree, ports, scheduler
    finally:
        rc = scheduler.stop()
    assert rc == 0, scheduler.log()


def test_the_scheduler_s_first_start_writes_its_keys_token_and_store_as_its_unit_allows(
    control_plane,
):
    tree, _, _ = control_plane
    curve = tree.at("/etc/llmgw/pki/curve")
    for name in ("scheduler", "gpu-01", "router-1"):
        assert owned_by_llmgw(tree, curve / f"{name}.key_secret", 0o600)
    assert owned_by_llmgw(tree, tree.at("/etc/llmgw/secrets/admin.token"), 0o600)
    assert tree.at("/var/lib/llmgw/llmgw.db").exists()


def test_an_agent_starts_as_its_unit_runs_it_and_joins_the_scheduler(control_plane, tmp_path):
    tree, _, _ = control_plane
    agent = Sandbox(tree, "llmgw-agentd.service").start(tmp_path / "agent.log")
    try:

        def joined():
            nodes = json.loads(ctl(tree, "nodes", "--json").stdout)
            return any(n["name"] == "gpu-01" and n["state"] == "up" for n in nodes)

        agent.wait_for(joined, "gpu-01 to report to the scheduler")
    finally:
        rc = agent.stop()
    assert rc == 0, agent.log()


def test_a_router_starts_as_its_unit_runs_it_and_answers(control_plane, tmp_path):
    tree, ports, _ = control_plane
    router = Sandbox(tree, "llmgw-router.service").start(tmp_path / "router.log")
    listen = ports["router"]
    try:

        def answers():
            return requests.get(f"http://{listen}/health", timeout=1).status_code in (200, 503)

        router.wait_for(answers, "the router's /health")
    finally:
        rc = router.stop()
    assert rc == 0, router.log()


def test_a_backup_runs_as_its_unit_runs_it_and_writes_an_archive(control_plane):
    tree, _, _ = control_plane
    result = Sandbox(tree, "llmgw-backup.service").run()
    assert result.returncode == 0, result.stderr
    archives = list(tree.at("/var/backups/llmgw").iterdir())
    assert len(archives) == 1 and owned_by_llmgw(tree, archives[0], 0o600), archives


def test_the_usage_rollup_runs_as_its_unit_runs_it(control_plane):
    tree, _, _ = control_plane
    result = Sandbox(tree, "llmgw-usage-rollup.service").run()
    assert result.returncode == 0, result.stderr


def test_certmon_makes_the_ca_issues_and_renews_where_its_renew_unit_may_write(tree, tmp_path):
    listen = scheduler_config(tree)["certmon"]
    renew = Sandbox(tree, "llmgw-certmon-renew.service")
    certmon = [str(BIN / "llmgw-certmon"), "--config", str(tree.config)]
    # docs/certificates.md: `sudo -u llmgw llmgw-certmon init-ca`, then `issue`.
    for args in (["init-ca"], ["issue", "router-1", "--san", "127.0.0.1"]):
        result = renew.run(certmon + args)
        assert result.returncode == 0, result.stderr
    result = renew.run(certmon + ["renew", "--before", "3650d"])
    assert result.returncode == 0 and "renewed router-1" in result.stdout, result.stderr
    pki = tree.at("/etc/llmgw/pki")
    assert owned_by_llmgw(tree, pki / "ca.key", 0o600)
    assert owned_by_llmgw(tree, pki / "router-1.key", 0o600)

    serve = Sandbox(tree, "llmgw-certmon.service").start(tmp_path / "certmon.log")
    try:

        def scraped():
            return 'cert="router-1"' in requests.get(f"http://{listen}/metrics", timeout=1).text

        serve.wait_for(scraped, "certmon's metrics")
    finally:
        rc = serve.stop()
    assert rc == 0, serve.log()


# -- what an install that missed a step is told ---------------------------------------------


def one_line_naming(result: subprocess.CompletedProcess, path: Path) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(path) in lines[0] and "install -d" in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "directory, what",
    [("/etc/llmgw/pki/curve", "CURVE keypair"), ("/etc/llmgw/secrets", "admin token")],
)
def test_a_scheduler_missing_a_directory_it_writes_says_which_in_one_line(tree, directory, what):
    scheduler_config(tree)
    tree.at(directory).rmdir()
    result = Sandbox(tree, "llmgw-scheduler.service").run()
    line = one_line_naming(result, tree.at(directory))
    assert what in line and "ReadWritePaths" in line


def test_a_scheduler_on_a_secrets_directory_it_may_not_write_says_so_in_one_line(tree):
    # The permissions docs/install.md gave before: root:llmgw 0750.
    scheduler_config(tree)
    secrets = tree.at("/etc/llmgw/secrets")
    os.chown(secrets, 0, tree.user.pw_gid)
    result = Sandbox(tree, "llmgw-scheduler.service").run()
    line = one_line_naming(result, secrets)
    assert "Permission denied" in line and "admin token" in line


def test_certmon_without_its_pki_directory_says_so_in_one_line(tree):
    scheduler_config(tree)
    shutil.rmtree(tree.at("/etc/llmgw/pki"))
    certmon = [str(BIN / "llmgw-certmon"), "--config", str(tree.config), "init-ca"]
    result = Sandbox(tree, "llmgw-certmon-renew.service").run(certmon)
    one_line_naming(result, tree.at("/etc/llmgw/pki"))


def test_nodes_add_on_a_key_directory_the_scheduler_may_not_write_says_so_in_one_line(
    control_plane,
):
    tree, _, scheduler = control_plane
    curve = tree.at("/etc/llmgw/pki/curve")
    os.chown(curve, 0, 0)  # as if copied in by root
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_STORE"}
    result = subprocess.run(
        [str(BIN / "llmgw"), "--config", str(tree.config), "nodes", "add", "gpu-02"],
        capture_output=True,
        text=True,
        env=env,
    )
    line = one_line_naming(result, curve)
    assert "Permission denied" in line and "CURVE keypair" in line
    assert "Traceback" not in scheduler.log()
