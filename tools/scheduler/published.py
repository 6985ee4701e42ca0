"""The routing table as last published, so that each change also goes out as a diff.

A router holding a table of 50,000 replicas spent about 400 ms of held GIL applying the
whole table again at every change and every snapshot (bench/SCHEDULER.md), most of it
decoding JSON for replicas it already had. A `routes_diff` carries only what changed
since the table the router holds; the whole `routes` table still goes out as before,
and a router that holds the table a diff starts from subscribes to diffs only.

Every table published, whole or as a diff, is numbered: `table` names this publisher's
lineage (new at every start and every takeover, so two processes never chain) and
`version` counts its publications (not `seq`, which a snapshot repeats: a table can
change without a new seq, so a seq does not name one content). A diff applies to the
version `base`; a router that holds any other ignores it and takes the next whole
table: it never applies a diff to a table it does not hold.

Pure: takes routes bodies, returns diff bodies.
"""

import secrets


class Published:
    """The last table published, by replica id, and the lineage it belongs to."""

    def __init__(self, lineage: str = ""):
        self.lineage = lineage or secrets.token_hex(6)
        self.epoch: int | None = None  # of the last table published; None: none yet
        self.version = 0  # of the last table published in this lineage; 0: none yet
        self.replicas: dict[str, dict] = {}
        self.models: list = []

    def publish(self, body: dict, epoch: int) -> dict | None:
        """Note `body` (a whole `routes` body) as published under `epoch`: mark it with
        this lineage and version and return the diff from the table published before it.
        None for the first table of a lineage (at start, and at each new epoch): no
        router holds a table it could chain to."""
        if epoch != self.epoch:
            if self.epoch is not None:
                self.lineage = secrets.token_hex(6)
            self.epoch, self.version, self.replicas, self.models = epoch, 0, {}, []
        base, self.version = self.version, self.version + 1
        body["table"], body["version"] = self.lineage, self.version
        replicas = {r["id"]: r for r in body["replicas"]}
        changed = [r for rid, r in replicas.items() if self.replicas.get(rid) != r]
        removed = [rid for rid in self.replicas if rid not in replicas]
        diff = {"seq": body["seq"], "table": self.lineage, "version": self.version,
                "base": base, "replicas": changed, "removed": removed}  # fmt: skip
        models = body.get("models", [])
        if models != self.models:
            diff["models"] = models
        self.replicas, self.models = replicas, models
        return diff if base else None
