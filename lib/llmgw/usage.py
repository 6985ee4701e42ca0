"""Usage reports, and the daily rollup that keeps the raw usage table from growing
without bound (LiteLLM's spend log is known to: millions of rows, slow dashboards).

Routers write one raw row per request. `rollup()` (`llmgw usage rollup`, daily from a
systemd timer) sums each complete UTC day into `usage_daily`, one row per attribution
(key, user, project, team, org, requested and served model), then deletes raw rows
older than the retention. A day is rolled up once; rows that arrive for it later (a
router that buffered through a store outage) are rolled up by the next run.

Reports add the rollups of rolled-up days to the raw rows of the days after them, so
a report reaching back past the last rollup counts those days whole.
"""

import peewee

from llmgw import periods
from llmgw.store import Usage
from llmgw.store.tenancy import UsageDaily, UsageDay

DAY = 86400
# A day is rolled up this long after it ended: routers flush their buffers every
# second, so by then its rows are in.
GRACE_S = 3600
BY = ("key", "user", "project", "team", "org", "model")
_ATTRIBUTION = ("key_id", "user", "project", "team", "org", "model", "served_model")
TOTALS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cost")


def rollup(now: float, retention_days: int) -> dict:
    """Roll up every complete day not yet (fully) rolled up, then prune raw rows older
    than `retention_days` (0: keep them). Returns what was done."""
    until = periods.day_start(now - GRACE_S)  # days before this are complete
    first = Usage.select(peewee.fn.MIN(Usage.at)).where(Usage.at < until).scalar()
    rolled, rows = [], 0
    if first is not None:
        done = {d.day: d for d in UsageDay.select()}
        day = periods.day_start(first)
        while day < until:
            mark = done.get(float(day))
            after = mark.last_id if mark else 0
            in_day = (Usage.at >= day) & (Usage.at < day + DAY) & (Usage.id > after)
            last = Usage.select(peewee.fn.MAX(Usage.id)).where(in_day).scalar()
            if last is not None:
                rows += _roll_day(day, in_day & (Usage.id <= last), last, now, mark)
                rolled.append(day)
            day += DAY
    pruned = 0
    if retention_days > 0:
        cutoff = periods.day_start(now) - retention_days * DAY
        # Only rolled-up rows: the rest wait for the next run (as they will never be
        # older than the cutoff and unrolled unless rollup itself failed).
        rolled_ids = [(d.day, d.last_id) for d in UsageDay.select().where(UsageDay.day < cutoff)]
        for day, last_id in rolled_ids:
            pruned += (
                Usage.delete()
                .where((Usage.at >= day) & (Usage.at < day + DAY) & (Usage.id <= last_id))
                .execute()
            )
    return {"days_rolled_up": len(rolled), "rollup_rows": rows, "raw_rows_pruned": pruned}


def _roll_day(day: int, where, last_id: int, now: float, mark) -> int:
    cols = [getattr(Usage, c) for c in _ATTRIBUTION]
    q = (
        Usage.select(
            *cols,
            peewee.fn.COUNT(Usage.id).alias("requests"),
            peewee.fn.SUM(peewee.Case(None, [(Usage.status >= 400, 1)], 0)).alias("errors"),
            peewee.fn.SUM(Usage.prompt_tokens).alias("prompt_tokens"),
            peewee.fn.SUM(Usage.completion_tokens).alias("completion_tokens"),
            peewee.fn.SUM(Usage.cost).alias("cost"),
        )
        .where(where)
        .group_by(*cols)
        .dicts()
    )
    db = Usage._meta.database
    with db.atomic():
        out = [{**r, "day": float(day)} for r in q]
        for r in out:
            for k in ("requests", "errors", "prompt_tokens", "completion_tokens"):
                r[k] = int(r[k] or 0)
        for i in range(0, len(out), 200):
            UsageDaily.insert_many(out[i : i + 200]).execute()
        if mark is None:
            UsageDay.insert(day=float(day), rolled_at=now, last_id=last_id).execute()
        else:
            UsageDay.update(rolled_at=now, last_id=last_id).where(
                UsageDay.day == float(day)
            ).execute()
    return len(out)


def _group(model, by: str):
    if by == "model":
        return peewee.fn.COALESCE(model.served_model, model.model)
    return getattr(model, "key_id" if by == "key" else by)


def report(by: str, since: float, now: float) -> list[dict]:
    """Totals per key, user, project, team, org or (served) model since `since`."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}")
    rolled_through = UsageDay.select(peewee.fn.MAX(UsageDay.day)).scalar()
    rolled_through = rolled_through + DAY if rolled_through is not None else None
    totals: dict = {}

    def add(model, where, count_expr):
        g = _group(model, by)
        errors = (
            peewee.fn.SUM(peewee.Case(None, [(model.status >= 400, 1)], 0))
            if model is Usage
            else peewee.fn.SUM(model.errors)
        )
        q = (
            model.select(
                g.alias("name"),
                count_expr.alias("requests"),
                errors.alias("errors"),
                peewee.fn.SUM(model.prompt_tokens).alias("prompt_tokens"),
                peewee.fn.SUM(model.completion_tokens).alias("completion_tokens"),
                peewee.fn.SUM(model.cost).alias("cost"),
            )
            .where(where)
            .group_by(g)
            .dicts()
        )
        for r in q:
            t = totals.setdefault(r["name"], dict.fromkeys(TOTALS, 0))
            for k in TOTALS:
                if k == "cost":
                    if r[k] is not None:
                        t[k] = (t[k] or 0) + float(r[k])
                else:
                    t[k] += int(r[k] or 0)

    raw_from = since if rolled_through is None else max(since, rolled_through)
    add(Usage, Usage.at >= raw_from, peewee.fn.COUNT(Usage.id))
    if rolled_through is not None and since < rolled_through:
        add(UsageDaily, UsageDaily.day >= periods.day_start(since), peewee.fn.SUM(
            UsageDaily.requests))  # fmt: skip
    out = [{by: name, **t} for name, t in totals.items()]
    for row in out:
        row["cost"] = round(row["cost"], 6)
    out.sort(key=lambda r: (-(r["prompt_tokens"] + r["completion_tokens"]), str(r[by])))
    return out
