"""How long each model takes to come back: seconds from the decision to start a replica
until it is ready (weights fetched, engine loaded), measured on every start and kept in
memory. Eviction weighs them (eviction.py); a restarted scheduler measures afresh."""

# Before a model's first measured start: a guess for a model of a few GiB loaded from
# local disk. Every unmeasured model gets the same, so among them demand decides.
DEFAULT_S = 60.0
# Each new measurement moves the estimate this far toward it: one slow start (weights
# fetched from the mirror once) does not make the model look slow for good.
WEIGHT = 0.5


class ColdStarts:
    def __init__(self):
        self.seconds: dict[str, float] = {}  # model -> its estimated cold start

    def record(self, model: str, seconds: float) -> None:
        if seconds < 0:
            return
        before = self.seconds.get(model)
        self.seconds[model] = seconds if before is None else before + WEIGHT * (seconds - before)

    def of(self, model: str) -> float:
        return self.seconds.get(model, DEFAULT_S)
