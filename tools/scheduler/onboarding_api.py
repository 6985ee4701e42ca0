"""The admin API's record of how each node was onboarded, for `llmgw nodes upgrade`.

GET  /v1/nodes/NAME/access   {"node", "access": {...}, "updated_at"} (404: not onboarded)
POST /v1/nodes/NAME/access   {"access": {...}}: what `llmgw nodes onboard` used

The record holds an ssh target, the path of a key file on the operator's machine and
ssh options, never a secret. It is forgotten with the node (`llmgw nodes remove`).
"""

import json
import time

from llmgw.errors import Invalid, NotFound
from llmgw.store import NodeAccess


def access_json(row: NodeAccess) -> dict:
    return {"node": row.node, "access": json.loads(row.access), "updated_at": row.updated_at}


def show(h, name: str):
    row = NodeAccess.get_or_none(NodeAccess.node == name)
    if row is None:
        raise NotFound(
            f"{name} was not onboarded with `llmgw nodes onboard`: onboard it (on a"
            " registered node that upgrades it)",
            code="not_onboarded",
        )
    return 200, access_json(row)


def record(h, name: str):
    access = h.body.get("access")
    if not isinstance(access, dict) or not isinstance(access.get("ssh"), str):
        raise Invalid("access must be an object with at least ssh")
    now = time.time()
    text = json.dumps(access, sort_keys=True)
    (NodeAccess.insert(node=name, access=text, updated_at=now)
     .on_conflict(conflict_target=[NodeAccess.node],
                  update={NodeAccess.access: text, NodeAccess.updated_at: now})
     .execute())  # fmt: skip
    h.audit(name, ssh=access["ssh"])
    return 200, access_json(NodeAccess.get(NodeAccess.node == name))
