"""`llmgw status`, `models`, `replicas`, `explain-placement` and `retry`: the live fleet,
as the scheduler's admin API reports it."""

import time

import click

from llmgw.human import age
from llmgw.human import size as human_size
from llmgw.placement import size
from llmgw_ctl.api import client, model_path
from llmgw_ctl.common import json_option, pass_state, print_json, print_table, queued
from llmgw_ctl.restart import print_restarts

# Model states an operator must act on; `backoff` heals itself but says why it is failing.
NEEDS_ACTION = ("parked", "unplaceable")
EXPLAINED = (*NEEDS_ACTION, "backoff")


def gib(n) -> str:
    return f"{(n or 0) / 2**30:.1f}"


def duration(seconds: float | None) -> str:
    """Seconds as `age` shows them; '-' for none."""
    return "-" if seconds is None else age(0.0, seconds)


def last_line(text: str, limit: int = 120) -> str:
    """An engine's reason is its output's tail; the last line is what went wrong."""
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def gpus_text(gpus: list) -> str:
    if not gpus:
        return "-"
    free = sum(g.get("memory_free") or 0 for g in gpus)
    total = sum(g.get("memory_total") or 0 for g in gpus)
    return f"{len(gpus)} ({gib(free)}/{gib(total)} GiB free)"


def disk_text(n: dict) -> str:
    """Free/total GiB of the node's state directory, and weights on their way."""
    if not n.get("disk_total"):
        return "-"
    text = f"{gib(n.get('disk_free'))}/{gib(n.get('disk_total'))}"
    fetching = n.get("fetching") or []
    if fetching:
        done = sum(f.get("done") or 0 for f in fetching)
        size = sum(f.get("size") or 0 for f in fetching) or 1
        text += f" (fetching {100 * done // size}%)"
    return text


def engine_state(info: dict) -> str:
    """An engine's state on a node as `llmgw nodes` says it: "installed (cpu)", "installing",
    "failed (retry in 40s)"; the reason is said on a line of its own."""
    state = info.get("state") or "?"
    if state == "installed":
        can_use = info.get("accelerators")
        return f"installed ({'+'.join(can_use)})" if can_use else state
    if state == "failed" and info.get("retry_in_s") is not None:
        wait = float(info["retry_in_s"])
        return f"failed ({'retrying now' if wait <= 0 else f'retry in {duration(wait)}'})"
    return state


def print_nodes(nodes: list[dict], now: float) -> None:
    """The NODE shape as aligned columns, then why each failed engine install failed."""
    print_table(
        ["NAME", "STATE", "MEMORY GiB (FREE/TOTAL)", "GPUS", "REPLICAS", "DISK GiB (FREE/TOTAL)",
         "VERSION", "LAST SEEN", "ENGINES"],
        [
            [
                n["name"],
                n["state"],
                f"{gib(n.get('memory_available'))}/{gib(n.get('memory_total'))}"
                if n["state"] != "never seen" and n.get("memory_available") is not None
                else "-",
                gpus_text(n.get("gpus") or []),
                str(n.get("replicas", 0)),
                disk_text(n),
                n.get("version") or "-",
                age(n.get("last_seen"), now) + (" ago" if n.get("last_seen") else ""),
                ", ".join(f"{eid} {engine_state(info)}"
                          for eid, info in sorted((n.get("engines") or {}).items())) or "-",
            ]
            for n in nodes
        ],
    )  # fmt: skip
    for n in nodes:
        for eid, info in sorted((n.get("engines") or {}).items()):
            if info.get("state") == "failed":
                # "failed: REASON (retry in 40s)", the reason's last line.
                why = last_line(info.get("reason", "")) or "no reason given"
                retry = engine_state(info).removeprefix("failed")
                click.echo(f"{n['name']}: {eid} failed: {why}{retry}")


def print_models(models: list[dict], detail: bool = False) -> None:
    """The MODEL shape as aligned columns, the ones that need an operator first."""
    rows = []
    for m in sorted(models, key=lambda m: m["state"] not in NEEDS_ACTION):
        why = last_line(m.get("reason", "")) if m["state"] in EXPLAINED else ""
        # Else the autoscaler's word: "scaled up 12:04: 2 of 2 replicas saturated 45 s".
        why = why or m.get("desired_reason", "")
        if m.get("adapter_of"):  # a LoRA adapter: where its base's replicas hold it
            on = ", ".join(f"{x['replica']} ({x['node']})" for x in m.get("loaded_on", ()))
            where = f"adapter of {m['adapter_of']}, " + (f"loaded on {on}" if on else "not loaded")
            why = f"{where}; {why}" if why else where
        # What it should have now (an on-demand model in use wants one), not its min: a
        # wanted on-demand model with no replica reads 0/1, missing.
        ready = f"{m.get('ready', 0)}/{m.get('desired', m.get('min', 0))}"
        if m.get("lost"):
            ready += f" (+{m['lost']} lost)"
        if detail:
            rows.append(
                [
                    m["name"],
                    m.get("engine", ""),
                    ready,
                    str(m.get("max", "")),
                    size(m["memory"]) if m.get("memory") else "-",
                    m["state"],
                    str(m.get("failures", 0)),
                    why,
                ]
            )
        else:
            rows.append([m["name"], ready, m["state"], why])
    if detail:
        headers = ["NAME", "ENGINE", "READY/DESIRED", "MAX", "MEMORY", "STATE", "FAILURES",
                   "REASON"]  # fmt: skip
    else:
        headers = ["NAME", "READY/DESIRED", "STATE", "REASON"]
    print_table(headers, rows)


def replica_state(r: dict) -> str:
    """'ready', 'ready (restart queued)', 'ready (stale)': what an operator acts on."""
    notes = [f"restart {r['restart']}"] if r.get("restart") else []
    if r.get("stale"):
        notes.append("stale")
    return r["state"] + (f" ({', '.join(notes)})" if notes else "")


def control_plane_line(cp: dict) -> str:
    """'LEADER s1 (epoch 3, lease 12.1s left)  STANDBY s2 (seen 0.4s ago)', or what is
    wrong with the leader: not heard from while its lease runs, or no valid lease."""
    if cp.get("store_error"):
        head = f"LEADER unknown: the store is unreachable ({cp['store_error']})"
    elif cp.get("leader"):
        head = _leader_text(cp["leader"], cp.get("successors"))
    else:
        head = _no_leader_text(cp.get("expired"), cp.get("successors"))
    others = [
        f"{s['name']} (seen {s['seen_s_ago']}s ago{copy_state(s)})"
        for s in cp.get("schedulers", ())
        if s["role"] == "standby"
    ]
    line = head + (f"  STANDBY {', '.join(others)}" if others else "")
    lacking = [
        f"{s['name']} has {copy_state(s).removeprefix(', ')}"
        for s in cp.get("schedulers", ())
        if s["role"] == "leader" and s.get("missing_blobs")
    ]
    line += "".join(f"  ({x})" for x in lacking)
    return line + f"  [answered by {cp['name']}, {cp['role']}]"


def copy_state(s: dict) -> str:
    """', mirror copied' or ', 3 files (2.0 GiB) to copy': how far a scheduler's own
    copy of the mirror and the releases is behind what the store names ('' if unsaid)."""
    n = s.get("missing_blobs")
    if n is None:
        return ""
    if n == 0:
        return ", mirror copied"
    return f", {n} file{'s' if n != 1 else ''} ({human_size(s.get('missing_bytes') or 0)}) to copy"


def _successors_text(successors) -> str:
    return " or ".join(successors) if successors else ""


def _leader_text(leader: dict, successors) -> str:
    name, epoch, left = leader["name"], leader["epoch"], leader["expires_in"]
    if not leader.get("presumed_down"):
        return f"LEADER {name} (epoch {epoch}, lease {left}s left)"
    seen = leader.get("seen_s_ago")
    silent = f"not seen for {seen}s" if seen is not None else f"{name} restarted since"
    who = _successors_text(successors)
    then = (f"{who} takes over when it runs out" if who
            else "no standby is running to take over")  # fmt: skip
    return f"LEADER {name} (epoch {epoch}, {silent}: presumed down; lease {left}s left, {then})"


def _no_leader_text(expired: dict | None, successors) -> str:
    head = "LEADER none: no scheduler holds a valid lease"
    if expired:
        head += (f" ({expired['name']}'s, epoch {expired['epoch']}, ran out"
                 f" {expired['expired_s_ago']}s ago)")  # fmt: skip
    who = _successors_text(successors)
    until = f" until {who} takes it" if who else ""
    return head + f"; nothing is placed or restarted{until}"


def print_replicas(replicas: list[dict], now: float, detail: bool = False) -> None:
    """The REPLICA shape as aligned columns."""
    if detail:
        rows = []
        for r in replicas:
            rows.append([
                r["id"], r["model"], r.get("profile") or "-", r["node"], replica_state(r),
                r.get("endpoint") or "-",
                age(r.get("created") or r.get("since"), now), duration(r.get("idle_s")),
                size(r["rss"]) if r.get("rss") else "-", last_line(r.get("reason") or ""),
            ])  # fmt: skip
            # A replica across nodes: one line per worker, under its leader.
            for w in r.get("shards") or ():
                rows.append([
                    f"  {w['id']}", "(worker)", "", w["node"], w["state"],
                    w.get("endpoint") or "-",
                    "", "", size(w["memory"]) if w.get("memory") else "-", "",
                ])  # fmt: skip
        print_table(
            ["ID", "MODEL", "PROFILE", "NODE", "STATE", "ENDPOINT", "AGE", "IDLE", "RSS", "REASON"],
            rows,
        )
        return
    print_table(
        ["ID", "MODEL", "NODE", "STATE", "AGE", "IDLE"],
        [
            [
                r["id"],
                r["model"],
                r["node"],
                replica_state(r),
                age(r.get("created") or r.get("since"), now),
                duration(r.get("idle_s")),
            ]
            for r in replicas
        ],  # fmt: skip
    )


def hint_actions(models: list[dict]) -> None:
    """Say, on stderr, what to do about each model that will not come back by itself."""
    for m in models:
        if m["state"] == "parked":
            click.echo(
                f"{m['name']} is parked after {m.get('failures', 0)} failed starts:"
                f" fix the cause, then `llmgw retry {m['name']}`",
                err=True,
            )
        elif m["state"] == "unplaceable":
            click.echo(
                f"{m['name']} fits no node: see `llmgw explain-placement {m['name']}`", err=True
            )


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the API's status object as is.")
@pass_state
def status(state, as_json):
    """The live fleet: nodes, models and replicas.

    Each model shows its ready replicas against its minimum. Models that are parked or
    fit no node come first, with the reason, and what to do is said on stderr.

    \b
    Examples:
      llmgw status
      llmgw status --json | jq -r '.models[] | select(.state=="parked") | .name'
      LLMGW_ADMIN_URL=http://sched-01:8081 llmgw status
    """
    body = client(state).get("/v1/status")
    if as_json:
        print_json(body)
        return
    now = time.time()
    if body.get("control_plane"):
        click.echo(control_plane_line(body["control_plane"]))
        click.echo()
    click.echo("NODES")
    print_nodes(body["nodes"], now)
    click.echo("\nMODELS")
    print_models(body["models"])
    click.echo("\nREPLICAS")
    print_replicas(body["replicas"], now)
    if body.get("restarts"):
        click.echo("\nRESTARTS")
        print_restarts(body["restarts"])
    hint_actions(body["models"])


@click.group("models", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_context
def models(ctx, as_json):
    """Models and their state (the default command is `list`).

    \b
    Examples:
      llmgw models
      llmgw models --json | jq -r '.[] | select(.state=="unplaceable") | .name'
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(models_list, as_json=as_json)


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def models_list(state, as_json):
    """Every configured model: replicas ready against what it wants now, state, and why
    (the autoscaler's last decision, or what blocks a scale-up)."""
    body = client(state).get("/v1/models")
    if as_json:
        print_json(body)
        return
    print_models(body, detail=True)
    hint_actions(body)


@click.command("replicas")
@click.option("--model", help="Only this model's replicas.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def replicas(state, model, as_json):
    """Replicas: where each runs, the profile it runs, its state, endpoint and age.

    A model with several profiles ([[models.profiles]]) is started with the first that
    fits some node; PROFILE (`profile` in --json) says which each replica got.

    \b
    Examples:
      llmgw replicas --model gemma3-270m
      llmgw replicas --json | jq -r '.[] | select(.state!="ready") | .id'
    """
    body = client(state).get("/v1/replicas", model=model)
    if as_json:
        print_json(body)
        return
    print_replicas(body, time.time(), detail=True)


@click.command("explain-placement")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the placement as JSON.")
@pass_state
def explain_placement(state, model, as_json):
    """Which node MODEL would go to, and why not each of the others.

    The scheduler's own placement, run now against what the nodes last reported. A
    model with several profiles is shown at the first that fits; if none fits, each
    node's reason names every profile ("2gpu: needs 2 GPUs, has 1 | cpu: ...").

    \b
    Examples:
      llmgw explain-placement gemma3-270m
      llmgw explain-placement gemma3-270m --json | jq -r '.nodes[] | select(.fits|not) | .reason'
    """
    body = client(state).get(model_path(model, "placement"))
    if as_json:
        print_json(body)
        return
    need = body.get("need") or {}
    gpus = need.get("gpus") or 0
    profiles = body.get("profiles") or []
    at = f" (profile {body['profile']}, of {', '.join(profiles)})" if len(profiles) > 1 else ""
    click.echo(
        f"{body['model']}{at} needs {size(need.get('memory') or 0)}"
        f"{f' on {gpus} GPU' + 's' * (gpus != 1) if gpus else ''}"
        f" and engine {need.get('engine', '?')}"
    )
    if body["nodes"]:
        print_table(
            ["NODE", "FITS", "WHY NOT"],
            [[n["name"], "yes" if n["fits"] else "no", n.get("reason", "")] for n in body["nodes"]],
        )
        for n in body["nodes"]:
            if n.get("gpu_link"):
                click.echo(f"{n['name']}: {n['gpu_link']}")
            for g in n.get("gpus") or []:
                if g.get("why_not"):
                    click.echo(f"{n['name']}: GPU {g['index']} ({g['uuid']}) {g['why_not']}")
    else:
        click.echo("no node has reported to the scheduler")
    if body.get("choice"):
        install = " (after installing the engine there)" if body.get("install") else ""
        click.echo(f"choice: {body['choice']}{install}")
    else:
        click.echo("choice: none; it fits no node")


@click.command("retry")
@click.argument("model")
@json_option
@pass_state
def retry(state, model, as_json):
    """Unpark MODEL and forget its failed starts.

    The scheduler starts it again on its next pass; the change is queued, so success
    means the scheduler accepted it, not that the model is serving yet.

    \b
    Examples:
      llmgw retry gemma3-270m
      llmgw models --json | jq -r '.[] | select(.state=="parked") | .name' | xargs -n1 llmgw retry
    """
    body = client(state).post(model_path(model, "retry"))
    queued(body, as_json, f"{body.get('queued', 'retry')} {body.get('model', model)}")
