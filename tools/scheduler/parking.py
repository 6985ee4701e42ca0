"""Failed starts: each backs its model off, and five in a row park it until an operator
runs `llmgw retry`. Parks are kept in the store, so they outlive a restart."""

from llmgw import log
from llmgw.reconciler import Backoff, after_failure, after_success
from llmgw.store import ParkedModel
from llmgw_scheduler.models import Catalog

_log = log.get("llmgw.scheduler")

# Failed starts in a row before a model is parked: a model whose weights its engine could
# not load was once started 155 times over eight hours.
PARK_AFTER = 5


class Parking:
    def __init__(self, catalog: Catalog, cfg, rng, leading, flags):
        self.catalog = catalog
        self.cfg = cfg  # the scheduler section: backoff_base_s, backoff_max_s
        self.rng = rng
        self.leading = leading
        self.flags = flags
        self.backoff: dict[str, Backoff] = {}
        self.parked: dict[str, ParkedModel] = {}
        self.last_error: dict[str, str] = {}  # model -> its last failed start's reason

    def load(self) -> None:
        """Parked models survive a restart, unless their definition changed meanwhile."""
        for row in ParkedModel.select():
            m = self.catalog.models.get(row.model)
            if m is not None and m.definition_hash() == row.profile:
                self.parked[row.model] = row
            else:
                _log.info("model_unparked", model=row.model, why="definition changed")
                row.delete_instance()

    def reload(self) -> None:
        self.parked.clear()
        self.load()

    def prune(self) -> None:
        """Forget the parks of models no longer in the catalog."""
        for gone in [name for name in self.parked if name not in self.catalog.models]:
            del self.parked[gone]

    def succeeded(self, model: str) -> None:
        self.backoff[model] = after_success(self.backoff.get(model, Backoff()))

    def failed(self, model: str, now: float, reason: str = "", counts: bool = True) -> None:
        """A replica of `model` failed. Only its engine's failure (`counts`: not a node
        lost, an agent restarted, or a served replica vanishing from a heartbeat) backs
        off and counts toward parking: a node crash once counted as one, so five crashes
        would have parked a healthy model. A standby keeps the count quietly: retrying
        is the leader's to say."""
        if not counts:
            return
        if reason:
            self.last_error[model] = reason[-2000:]
        b = after_failure(self.backoff.get(model, Backoff()), now, self.rng,
                          self.cfg.backoff_base_s, self.cfg.backoff_max_s)  # fmt: skip
        self.backoff[model] = b
        if self.leading():
            _log.warning("start_failed", model=model, failures=b.failures,
                         retry_in_s=round(b.next_at - now, 1))  # fmt: skip
        m = self.catalog.models.get(model)
        if m is not None and b.failures >= PARK_AFTER and model not in self.parked:
            if self.leading():  # a standby reads the park from the store when it takes over
                self._park(m, b.failures, now)

    def _park(self, m, failures: int, now: float) -> None:
        reason = self.last_error.get(m.name) or "its engine did not become ready"
        fields = {"profile": m.definition_hash(), "reason": reason, "failures": failures,
                  "parked_at": now}  # fmt: skip
        (
            ParkedModel.insert(model=m.name, **fields)
            .on_conflict(conflict_target=[ParkedModel.model], update=fields)
            .execute()
        )
        self.parked[m.name] = ParkedModel(model=m.name, **fields)
        self.flags.routes_dirty = True
        _log.error(
            "model_parked",
            model=m.name,
            failures=failures,
            reason=reason.strip().splitlines()[-1][:300] if reason.strip() else None,
            action="run `llmgw retry MODEL` once fixed",
        )

    def retry(self, model: str) -> None:
        """Forget a model's failures and park, and place it at once; NotFound if none."""
        self.catalog.get(model)
        ParkedModel.delete().where(ParkedModel.model == model).execute()
        self.parked.pop(model, None)
        self.backoff.pop(model, None)
        self.flags.routes_dirty = self.flags.wake = True
        _log.info("model_retry", model=model)

    def removed(self, model: str) -> None:
        """A runtime model was removed: its park goes with it."""
        ParkedModel.delete().where(ParkedModel.model == model).execute()
        self.parked.pop(model, None)
