"""`llmgw models add|remove` and `llmgw scale`: change the catalog without a restart."""

import tomllib

import click

from llmgw_ctl.api import client, model_path
from llmgw_ctl.common import json_option, pass_state, print_json, queued
from llmgw_ctl.status import models


@models.command("add")
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True, help="Print the model as the API sees it.")
@pass_state
def models_add(state, file, as_json):
    """Add a model from FILE (TOML with the keys of one [[models]] table; - for stdin).

    It is checked like the config's models, kept in the store (so it survives
    restarts) and placed on the scheduler's next pass.

    \b
    Example:
      cat > qwen.toml <<'EOT'
      name = "qwen2.5-0.5b"
      source = "/models/qwen2.5-0.5b-q4_k_m.gguf"
      [profile]
      context = 4096
      [scaling]
      min = 0
      EOT
      llmgw models add qwen.toml
    """
    try:
        table = tomllib.load(file)
    except tomllib.TOMLDecodeError as e:
        raise click.ClickException(f"{file.name}: {e}") from None
    if "models" in table and isinstance(table["models"], list) and len(table["models"]) == 1:
        table = table["models"][0]  # a [[models]] table pasted from a config file
    body = client(state).post("/v1/models", table)
    if as_json:
        print_json(body)
    else:
        click.echo(f"added {body.get('name', '?')}: {body.get('state', '')}", err=True)


@models.command("remove")
@click.argument("name")
@json_option
@pass_state
def models_remove(state, name, as_json):
    """Remove a model added with `models add`; its replicas are stopped.

    Models in the config file are removed there, not here.
    """
    body = client(state).delete(model_path(name, "").rstrip("/"))
    queued(body, as_json, f"remove {name}")


@click.command("scale")
@click.argument("model")
@click.option(
    "--min",
    "min_",
    type=click.IntRange(0),
    required=True,
    help="Replicas always running (0: on demand).",
)
@click.option("--max", "max_", type=click.IntRange(1), required=True, help="Replicas at most.")
@json_option
@pass_state
def scale(state, model, min_, max_, as_json):
    """Set how many replicas MODEL runs; it outlives restarts and definition edits.

    \b
    Examples:
      llmgw scale gemma3-270m --min 2 --max 4
      llmgw scale big-model --min 0 --max 1     # on demand from now on
    """
    if min_ > max_:
        raise click.BadParameter(f"--min {min_} is above --max {max_}")
    body = client(state).post(model_path(model, "scale"), {"min": min_, "max": max_})
    queued(body, as_json, f"scale {model} to {min_}..{max_}")
