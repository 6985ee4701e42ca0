"""Usage reports, and the daily rollup that keeps the raw usage table from growing
without bound (LiteLLM's spend log is known to: millions of rows, slow dashboards).

Routers write one raw row per request. `rollup()` (`llmgw usage rollup`, daily from a
systemd timer) sums each complete UTC day into `usage_daily`, one row per attribution
(key, user, project, team, org, requested and served model), then deletes raw rows
older than the retention. Rows that arrive for a day after it was rolled up (a router
that buffered through a store outage) are counted by the next run: a day whose raw
row count changed is summed again, and late rows for a pruned day are added to it.

Reports add the rollups of rolled-up days to the raw rows of the days after them, so
a report reaching back past the last rollup counts those days whole.
"""

import peewee

from llmgw import periods
from llmgw.store import StoredResponse, Usage
from llmgw.store.tenancy import UsageDaily, UsageDay

DAY = 86400
# A day is rolled up this long after it ended: routers flush their buffers every
# second, so by then its rows are in.
GRACE_S = 3600
BY = ("key", "user", "project", "team", "org", "model")
_ATTRIBUTION = ("key_id", "user", "project", "team", "org", "model", "served_model")
TOTALS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cost")


def _prune_responses(cutoff: float) -> int:
    """Delete the stored Responses API conversations whose last response is older than
    `cutoff`: they hold what people wrote, kept no longer than the usage rows that record
    them. A conversation goes whole: each response is a link its later ones are rebuilt
    through, so an old first turn stays while a later turn is recent. Each pass deletes
    the old responses that nothing continues, which makes their previous ones the next
    pass's; a conversation of n turns takes n passes."""
    continued = StoredResponse.select(StoredResponse.previous_id).where(
        StoredResponse.previous_id.is_null(False)
    )
    pruned = 0
    while True:
        gone = (
            StoredResponse.delete()
            .where((StoredResponse.created_at < cutoff) & StoredResponse.id.not_in(continued))
            .execute()
        )
        if not gone:
            return pruned
        pruned += gone


def rollup(now: float, retention_days: int) -> dict:
    """Roll up every complete day whose raw rows are not all in its rollup yet, then
    prune raw rows older than `retention_days` (0: keep them). Returns what was done."""
    until = periods.day_start(now - GRACE_S)  # days before this are complete
    cutoff = periods.day_start(now) - retention_days * DAY if retention_days > 0 else None
    first = Usage.select(peewee.fn.MIN(Usage.at)).where(Usage.at < until).scalar()
    done = {"days_rolled_up": 0, "rollup_rows": 0, "raw_rows_pruned": 0, "responses_pruned": 0}
    if cutoff is not None:
        done["responses_pruned"] = _prune_responses(cutoff)
    if first is None:
        return done
    marks = {d.day: d for d in UsageDay.select()}
    day = periods.day_start(first)
    while day < until:
        in_day = (Usage.at >= day) & (Usage.at < day + DAY)
        prune = cutoff is not None and day + DAY <= cutoff
        with Usage._meta.database.atomic():
            mark = marks.get(float(day))
            last = Usage.select(peewee.fn.MAX(Usage.id)).where(in_day).scalar()
            if last is not None:
                rows = in_day & (Usage.id <= last)  # not any that arrive meanwhile
                n = Usage.select().where(rows).count()
                if mark is not None and mark.pruned:
                    # Late rows for a day already pruned: add them, and drop them.
                    done["rollup_rows"] += _insert(day, rows)
                    done["raw_rows_pruned"] += Usage.delete().where(rows).execute()
                    mark.rows += n
                    mark.rolled_at = now
                    mark.save()
                    done["days_rolled_up"] += 1
                else:
                    if mark is None or mark.rows != n:
                        UsageDaily.delete().where(UsageDaily.day == float(day)).execute()
                        done["rollup_rows"] += _insert(day, rows)
                        done["days_rolled_up"] += 1
                        if mark is None:
                            mark = UsageDay(day=float(day), rolled_at=now, rows=n)
                            mark.save(force_insert=True)
                        else:
                            mark.rows, mark.rolled_at = n, now
                            mark.save()
                    if prune:
                        done["raw_rows_pruned"] += Usage.delete().where(rows).execute()
                        mark.pruned = True
                        mark.save()
        day += DAY
    return done


def _insert(day: int, where) -> int:
    """Sum the raw rows `where` of one day into rollup rows; how many were made."""
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
    out = [{**r, "day": float(day)} for r in q]
    for r in out:
        for k in ("requests", "errors", "prompt_tokens", "completion_tokens"):
            r[k] = int(r[k] or 0)
    for i in range(0, len(out), 200):
        UsageDaily.insert_many(out[i : i + 200]).execute()
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
