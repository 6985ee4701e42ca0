"""llmgw-certmon's command line: the cluster's certificate authority."""

import json
import signal
import sys
import threading
from datetime import UTC, datetime, timedelta

import click
from prometheus_client import CollectorRegistry, start_http_server

from llmgw import cli, log
from llmgw.apikeys import parse_duration
from llmgw.errors import Error
from llmgw_certmon import certs, expiry
from llmgw_certmon.collector import CertCollector
from llmgw_certmon.pkidir import CA, PkiDir, check_name, pki_dir

_log = log.get("llmgw.certmon")


class State(cli.ConfigState):
    @property
    def pki(self) -> PkiDir:
        return PkiDir(pki_dir(self.cfg))


pass_state = click.make_pass_decorator(State)


def now() -> datetime:
    return datetime.now(UTC)


def duration(text: str, param: str) -> timedelta:
    try:
        return timedelta(seconds=parse_duration(text))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=param) from None


def day(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%d %H:%M:%SZ")


def print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2 if sys.stdout.isatty() else None))


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    for row in [headers, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@click.group(context_settings=cli.CONTEXT, invoke_without_command=True)
@cli.config_option
@cli.version_option
@click.pass_context
def main(ctx, config_path):
    """The cluster's certificate authority: issue and renew certificates, publish their expiry.

    Files live in certmon.dir (default <paths.config_dir>/pki): ca.key and ca.crt, and
    NAME.key and NAME.crt for every issued name. The default command is `list`.

    \b
    Examples:
      llmgw-certmon init-ca
      llmgw-certmon issue router-1 --san router-1.lan --san 10.0.0.5
      llmgw-certmon list --json | jq -r '.[] | select(.days_left < 30) | .name'
      llmgw-certmon check --warn 21d --crit 7d || echo "look at the certificates"
    """
    ctx.obj = State(config_path)
    if ctx.invoked_subcommand is None:
        ctx.invoke(certs_list)


@main.command("init-ca")
@click.option("--cn", default="llmgw CA", show_default=True, help="The CA's common name.")
@click.option(
    "--days",
    type=click.IntRange(min=1),
    help="Lifetime in days (default: certmon.ca_validity_days).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the CA certificate as JSON.")
@pass_state
def init_ca(state, cn, days, as_json):
    """Create the CA key (0600) and its self-signed certificate; never overwrites a CA."""
    pki = state.pki
    if pki.has_ca():
        raise click.ClickException(
            f"a CA already exists in {pki.path}: remove ca.key and ca.crt first to replace it "
            "(every certificate it issued stops verifying)"
        )
    t = now()
    issued = certs.make_ca(cn, days or state.cfg.certmon.ca_validity_days, t)
    try:
        pki.write_ca(issued)
    except Error as e:
        raise click.ClickException(str(e)) from None
    _say(f"created CA {issued.cert.subject.rfc4514_string()} in {pki.path}, "
         f"expires {day(issued.cert.not_valid_after_utc)}", as_json, pki, CA, t)  # fmt: skip


@main.command("issue")
@click.argument("name")
@click.option(
    "--san",
    "sans",
    multiple=True,
    required=True,
    metavar="DNS_OR_IP",
    help="A DNS name or IP address the certificate is valid for. Repeatable.",
)
@click.option(
    "--days", type=click.IntRange(min=1), help="Lifetime in days (default: certmon.validity_days)."
)
@click.option("--force", is_flag=True, help="Replace NAME's key and certificate if they exist.")
@click.option("--json", "as_json", is_flag=True, help="Print the certificate as JSON.")
@pass_state
def issue(state, name, sans, days, force, as_json):
    """Issue NAME.key and NAME.crt (CN=NAME, server and client auth), signed by the CA.

    \b
    Examples:
      llmgw-certmon issue node-a --san node-a.lan --san 10.0.0.7
      llmgw-certmon issue localhost --san localhost --san 127.0.0.1 --days 30
    """
    pki = state.pki
    try:
        check_name(name)
        names = [certs.parse_san(s) for s in sans]
        if not force and (pki.cert_path(name).exists() or pki.key_path(name).exists()):
            raise click.ClickException(
                f"{name} already exists in {pki.path}: use --force to replace it, "
                "or `llmgw-certmon renew`"
            )
        ca_key, ca_cert = pki.load_ca()
        t = now()
        issued = certs.issue(
            name, names, days or state.cfg.certmon.validity_days, t, ca_key, ca_cert
        )
        pki.write(name, issued)
    except Error as e:
        raise click.ClickException(str(e)) from None
    _say(f"issued {name}: {', '.join(certs.san_text(s) for s in names)}, "
         f"expires {day(issued.cert.not_valid_after_utc)}", as_json, pki, name, t)  # fmt: skip


def _say(message: str, as_json: bool, pki: PkiDir, name: str, t: datetime) -> None:
    """A line for people on stderr; with --json, the certificate's JSON shape on stdout."""
    click.echo(message, err=True)
    if as_json:
        found, _ = pki.read_all()
        print_json(next(expiry.cert_json(c, t) for c in found if c.name == name))


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array, one object per cert.")
@pass_state
def certs_list(state, as_json):
    """List every certificate: name, subject, SANs, not-after, days left."""
    pki = state.pki
    found, errors = pki.read_all()
    for name in sorted(errors):
        click.echo(f"warning: {errors[name]}", err=True)
    t = now()
    if as_json:
        print_json([expiry.cert_json(c, t) for c in found])
        return
    if not found:
        click.echo(f"no certificates in {pki.path}", err=True)
        return
    print_table(
        ["NAME", "SUBJECT", "SANS", "NOT AFTER", "DAYS LEFT"],
        [
            [
                c.name,
                c.subject,
                ",".join(certs.san_text(s) for s in certs.sans_of(c.cert)) or "-",
                day(c.not_after),
                f"{expiry.days_left(c, t):.1f}",
            ]
            for c in found
        ],
    )


@main.command("renew")
@click.option(
    "--before",
    help="Renew what expires within this, e.g. 30d (default: certmon.renew_before_days).",
)
@click.option(
    "--days",
    type=click.IntRange(min=1),
    help="New lifetime in days (default: certmon.validity_days).",
)
@click.option("--ca", "with_ca", is_flag=True, help="Renew the CA too (same key, new dates).")
@click.option("--json", "as_json", is_flag=True, help="Print the renewed certificates as JSON.")
@pass_state
def renew(state, before, days, with_ca, as_json):
    """Re-issue every certificate that expires soon: a new key, the same subject and SANs.

    Prints one line per renewed certificate. The CA is renewed only with --ca, and keeps
    its key, so every certificate it issued still verifies against the new ca.crt.

    \b
    Examples:
      llmgw-certmon renew                 # what systemd's llmgw-certmon-renew.timer runs daily
      llmgw-certmon renew --before 60d --ca
    """
    cfg = state.cfg.certmon
    window = duration(before, "--before") if before else timedelta(days=cfg.renew_before_days)
    pki = state.pki
    t = now()
    renewed = []
    try:
        found, errors = pki.read_all()
        for name in sorted(errors):
            click.echo(f"warning: not renewing {name}: {errors[name]}", err=True)
        todo = expiry.due(found, t, window, ca=with_ca)
        ca_key, ca_cert = pki.load_ca() if found else (None, None)
        if any(c.name == CA for c in todo):
            old = pki.read_cert(CA)
            issued = certs.make_ca(certs.common_name(old), cfg.ca_validity_days, t, key=ca_key)
            pki.write_ca(issued, replace=True)
            ca_cert = issued.cert
            renewed.append(CA)
        for c in todo:
            if c.name == CA:
                continue
            if c.cert.issuer != ca_cert.subject:
                click.echo(f"warning: not renewing {c.name}: not issued by this CA", err=True)
                continue
            cn = certs.common_name(c.cert) or c.name
            sans = certs.sans_of(c.cert)
            pki.write(c.name, certs.issue(cn, sans, days or cfg.validity_days, t, ca_key, ca_cert))
            renewed.append(c.name)
            _log.info("renewed", cert=c.name)
    except Error as e:
        raise click.ClickException(str(e)) from None
    after = {c.name: c for c in pki.read_all()[0]}
    if as_json:
        print_json([expiry.cert_json(after[n], t) for n in renewed])
    else:
        for n in renewed:
            click.echo(f"renewed {n}, expires {day(after[n].not_after)}")
    if not renewed:
        click.echo(f"nothing expires within {expiry.span(window)}", err=True)


@main.command("check")
@click.option("--warn", default="21d", show_default=True, help="Exit 1 if any expires within.")
@click.option("--crit", default="7d", show_default=True, help="Exit 2 if any expires within.")
@pass_state
def check(state, warn, crit):
    """One line, and an exit code by the nearest expiry, for scripts and monitoring.

    \b
    Exit codes:
      0  every certificate is valid beyond --warn
      1  one expires within --warn
      2  one expires within --crit, has expired, or cannot be read
      3  there are no certificates

    --warn defaults below certmon.renew_before_days: a certificate that waits a day for
    the daily renewal is normal, one still not renewed a week later is worth a look.
    """
    w, c = duration(warn, "--warn"), duration(crit, "--crit")
    found, errors = state.pki.read_all()
    verdict = expiry.check(found, errors, now(), w, c)
    click.echo(verdict.line)
    sys.exit(verdict.code)


@main.command("serve")
@click.option("--listen", help="HOST:PORT to serve /metrics on (overrides certmon.listen).")
@pass_state
def serve(state, listen):
    """Serve certificate expiry as Prometheus metrics, read from disk at every scrape.

    \b
    Metrics:
      llmgw_certificate_expiry_timestamp_seconds{cert,subject}
      llmgw_certificate_read_errors{cert}   1 while NAME.crt cannot be parsed
    """
    cfg = state.cfg
    log.setup("llmgw-certmon", cfg.log.level)
    host, port = cli.parse_listen(listen or cfg.certmon.listen)
    pki = state.pki
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CertCollector(pki))
    try:
        server, _ = start_http_server(port, host, registry=registry)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _log.info("starting", listen=f"{host}:{port}", dir=pki.path, certs=len(pki.names()))
    stop.wait()
    server.shutdown()
    _log.info("stopped")
