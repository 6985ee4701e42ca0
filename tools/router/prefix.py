"""Prefix-aware routing: send a request where its prompt is most likely cached already.

Bookkeeping, no I/O but its debug lines; `hold()` is its one wait. A request's key is the
canonical text of its prompt in the order the chat template renders it (model, tools,
then each message's role and content; a completion's prompt), cut into blocks of
`BLOCK_CHARS`, each block's hash chained on the previous one's, so one flat dict per
replica stands in for a trie: a request's match on a replica is the leading run of its
blocks that replica holds.

What a replica holds is a guess made from this router's own traffic (and, with
`router.prefix_peers`, its peers': share.py), bounded the way
the engine's cache is (llama.cpp: slots × context per slot), and corrected by what the
engine says it reused (`usage.prompt_tokens_details.cached_tokens`, llama-server's
`timings.cache_n`): where it reused far less than predicted, the chain is dropped there.
Work in flight is counted in prompt tokens, a decoded token weighing what the engine's
timings say it costs against a prompt token (on one CPU core about six). Other
routers' work is what they said they have in flight when they share, else their
requests on the engine at its last probe.
"""

import asyncio
import json
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from llmgw import log

_log = log.get("llmgw.router.prefix")

BLOCK_CHARS = 128
CHARS_PER_TOKEN = 4.0  # a start; the tokens engines report refine it per model
ENTRY_BYTES = 120  # what one remembered block costs: dict slot, int key, list links
# How much more a decoded token costs an engine than a prompt token, until its timings
# say (llama-server's `timings`: ms per predicted token / ms per prompt token).
DECODE_WEIGHT = 1.0
DECODE_WEIGHT_MAX = 20.0
# Below this many predicted tokens a miss proves nothing (one block is noise). Nor does
# a miss while another request of this router was using that prefix on the replica:
# llama-server keeps one copy of a prompt per slot, in the slot that last had it, and
# takes a host-cache copy into a slot rather than copying it; a second request arriving
# while that slot is busy evaluates the prompt again though the engine has it (a
# contended miss). The chain stays: the engine holds the prefix, now twice.
MISS_MIN_TOKENS = 2 * BLOCK_CHARS / CHARS_PER_TOKEN
# A request whose match on its replica is a prompt another request put there and is
# still evaluating would have it evaluated twice side by side: llama-server shares no
# work between slots, and a slot's prompt reaches its host cache only when the slot
# ends. It waits for that request to end instead (`hold`), when at least this many of
# its tokens are at stake, at most `router.prefix_hold_s`, and once the other's engine is
# answering, at most HOLD_GRACE times what that engine took to start answering (a long
# answer ahead must not cost more than evaluating the prompt again). One core, a
# 1,700-token system prompt: two together took 9.5 s and 16 s to a first token; one
# after the other, 8 s and then 0.1 s (bench/ROUTING-RUNS.md, run 40).
HOLD_MIN_TOKENS = 256
HOLD_GRACE = 0.5


def _text(content) -> str:
    """A message's content as text: a string, or the parts of a multimodal list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
                else:  # an image or audio part: its reference, sorted, stands for it
                    out.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "\x1d".join(out)
    if content is None:
        return ""
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def canonical(payload: dict) -> str | None:
    """The prompt as the engine will see it, in order; None for a request with none
    (embeddings, a malformed body: those route by load alone)."""
    parts = [str(payload.get("model", ""))]
    tools = payload.get("tools")
    if tools:
        parts.append("tools\x1e" + json.dumps(tools, sort_keys=True, separators=(",", ":")))
    for name in ("system", "instructions"):  # Anthropic's and the Responses API's
        if payload.get(name):
            parts.append("system\x1e" + _text(payload[name]))
    messages = payload.get("messages")
    if messages is None and isinstance(payload.get("input"), list):
        messages = payload["input"]  # the Responses API's items
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                return None
            text = _text(m.get("content"))
            if m.get("tool_calls"):
                text += "\x1d" + json.dumps(m["tool_calls"], sort_keys=True)
            parts.append(f"{m.get('role', '')}\x1e{text}")
        return "\x1f".join(parts)
    prompt = payload.get("prompt")
    if prompt is None and isinstance(payload.get("input"), str):
        prompt = payload["input"]
    if isinstance(prompt, str):
        return "\x1f".join([*parts, prompt])
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return "\x1f".join([*parts, ",".join(map(str, prompt))])  # token ids
    return None


def chain(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Each block's hash chained on the ones before (a crc32 and an adler32 of the text
    so far, as one 64-bit number): equal hashes at position i mean equal text up to the
    end of block i. Alike in every process, so routers can tell each other what they
    sent where (share.py)."""
    out, c, a = [], 0, 1
    crc, adler = zlib.crc32, zlib.adler32
    data = text.encode("utf-8", "surrogatepass")
    if len(data) == len(text):  # ASCII: a block's bytes are its characters
        for i in range(0, len(data), block_chars):
            b = data[i : i + block_chars]
            c, a = crc(b, c), adler(b, a)
            out.append(c << 32 | a)
        return tuple(out)
    for i in range(0, len(text), block_chars):
        b = text[i : i + block_chars].encode("utf-8", "surrogatepass")
        c, a = crc(b, c), adler(b, a)
        out.append(c << 32 | a)
    return tuple(out)


@dataclass(eq=False)
class Key:
    """One request's prompt as blocks, and what it costs a replica to take it."""

    model: str
    blocks: tuple[int, ...]
    chars: int
    session: str = ""
    max_tokens: int = 256  # decode work it brings, counted in tokens in flight
    # A hash of the prompt's first block that every router computes alike: it names the
    # replica a prompt goes to when nothing else decides (rendezvous hashing), so
    # routers that never saw each other's traffic still send a shared prompt one way.
    anchor: int = 0
    crc: int = 0  # of the whole prompt, at debug level only: names it in the trace
    # Set by choose() for the replica it went to, read back by served():
    matched: int = 0  # leading blocks that replica was thought to hold
    load: float = 0.0  # tokens of work added to that replica's in-flight count
    contended: bool = False  # another request was using its matched prefix there
    # The request still evaluating the prompt this one matched there, when worth waiting
    # for (see HOLD_MIN_TOKENS): hold() waits for it, and clears it.
    holder: "Key | None" = None
    # Its own attempt, as a holder: when it went to the engine and when the engine began
    # answering (the event loop's clock; call.py), whether it ended (served()), and
    # what its waiters wait on (set and replaced at each of those steps).
    sent_at: float = 0.0
    answered_at: float = 0.0
    ended: bool = False
    progress: asyncio.Event | None = None


def text_crc(text: str) -> int:
    """A crc32 of text, alike in every process (str's hash() is salted per process)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def request_key(payload: dict, session: str = "", block_chars: int = BLOCK_CHARS) -> Key | None:
    text = canonical(payload)
    if text is None:
        return None
    mt = payload.get("max_completion_tokens") or payload.get("max_tokens")
    mt = mt if isinstance(mt, int) and mt > 0 else 256
    anchor = text_crc(text[:block_chars])
    crc = text_crc(text) if _log.debugging else 0
    return Key(str(payload.get("model", "")), chain(text, block_chars), len(text), session, mt,
               anchor, crc)  # fmt: skip


class _Replica:
    __slots__ = ("blocks", "capacity", "inflight", "pending", "requests", "using")

    def __init__(self, capacity: int):
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.pending: dict[int, Key] = {}  # block -> the request in flight that added it
        self.using: dict[int, int] = {}  # block -> requests in flight whose prompt has it
        self.capacity = capacity  # blocks
        self.inflight = 0.0  # tokens of work this router has sent it and not seen end
        self.requests = 0  # requests this router has sent it and not seen end


@dataclass
class Outcome:
    predicted: float  # cached tokens the match promised
    actual: int  # cached tokens the engine reported
    dropped: int  # blocks forgotten because the engine reused far less


@dataclass
class PrefixIndex:
    """Per replica, an LRU of the block hashes it was sent; the choice among replicas."""

    alpha: float = 0.3  # weight of tokens already in flight against uncached tokens
    memory_bytes: int = 64 << 20  # ceiling over every replica's LRU together
    hold_s: float = 20.0  # the longest a request waits for another's prompt; 0: never
    block_chars: int = BLOCK_CHARS
    default_capacity_tokens: int = 8192  # a replica whose cache size nobody said
    _replicas: dict = field(default_factory=dict)
    _sessions: dict = field(default_factory=dict)  # session -> replica id (bounded LRU)
    _chars_per_token: dict = field(default_factory=dict)  # model -> learned ratio
    _decode_weight: dict = field(default_factory=dict)  # model -> learned (see DECODE_WEIGHT)
    _entries: int = 0
    _mean_load: float = 0.0  # tokens of work a request of this router adds, on average
    # What other routers sent where and have in flight (share.py): learn()'s arguments,
    # appended by the share's thread, taken in on the event loop at the next choice.
    inbox: deque = field(default_factory=deque)
    # Called with (replica, this router's requests and work in flight there, blocks)
    # after each choice, and with no blocks when a request ends: to share it.
    on_change: object = None
    _peer_load: dict = field(default_factory=dict)  # (peer, replica) -> (requests, work)
    _table: set | None = None  # the replicas of the routing table (forget()), once known

    # -- sizes ------------------------------------------------------------------------

    def blocks_for(self, tokens: int, model: str = "") -> int:
        return max(1, int(tokens * self.chars_per_token(model) / self.block_chars))

    def chars_per_token(self, model: str) -> float:
        return self._chars_per_token.get(model, CHARS_PER_TOKEN)

    def decode_weight(self, model: str) -> float:
        return self._decode_weight.get(model, DECODE_WEIGHT)

    def size(self, replica: str, cache_tokens: int, model: str = "") -> None:
        """How much the engine behind `replica` caches (llama.cpp: slots × ctx per
        slot; vLLM: KV blocks × block size), in tokens."""
        r = self._replica(replica)
        cap = self.blocks_for(cache_tokens, model)
        if cap != r.capacity:
            r.capacity = cap
            self._trim(r)

    def _replica(self, rid: str) -> _Replica:
        r = self._replicas.get(rid)
        if r is None:
            r = self._replicas[rid] = _Replica(self.blocks_for(self.default_capacity_tokens))
        return r

    def held(self, replica: str) -> int:
        r = self._replicas.get(replica)
        return len(r.blocks) if r is not None else 0

    def inflight(self, replica: str) -> float:
        r = self._replicas.get(replica)
        return r.inflight if r is not None else 0.0

    def forget(self, keep) -> None:
        """Drop replicas not in `keep` (they left the routing table)."""
        self._table = set(keep)
        for rid in [r for r in self._replicas if r not in keep]:
            self._entries -= len(self._replicas.pop(rid).blocks)
        for k in [k for k in self._peer_load if k[1] not in keep]:
            del self._peer_load[k]
        for s in [s for s, rid in self._sessions.items() if rid not in keep]:
            del self._sessions[s]

    # -- matching ---------------------------------------------------------------------

    def match(self, replica: str, key: Key) -> int:
        """The leading run of `key`'s blocks that `replica` holds."""
        r = self._replicas.get(replica)
        if r is None:
            return 0
        n = 0
        for h in key.blocks:
            if h not in r.blocks:
                break
            n += 1
        return n

    def choose(self, candidates, key: Key, slots_of=lambda ep: 0, others_of=lambda ep: 0):
        """The candidate (anything with `.id` and `.outstanding`) minimising uncached
        prompt tokens + alpha × tokens in flight; ties to the client's session, then to
        the least outstanding. Every candidate but the prompt's rendezvous-hash first
        choice (and the session's) pays one block more, so between near equals routers
        that never saw each other's traffic choose alike. A load guard overrides the
        cache when one replica has piled up far more requests than another, and where
        the move would cost the prompt, requests sharing it alone did (`_may_move`).
        Records the choice (see `sent`).

        `others_of(ep)`: requests other routers have in flight there, as far as the
        engine said lately (probe.py). Each counts as this router's average request in
        the work in flight, and in the load guard: a router that saw only its own
        requests sent its share of a conversation group to a replica another router had
        already filled, and the requests queued in the engine (bench/ROUTING.md, two
        routers)."""
        if not candidates:
            return None
        inbox = self.inbox
        while inbox:
            self.learn(*inbox.popleft())
        cpt = self.chars_per_token(key.model)
        per_block = self.block_chars / cpt
        sticky = self._sessions.get(key.session) if key.session else None
        # Other routers' (requests, tokens of work) in flight on each candidate: what they
        # said themselves when they share, else the probe's count at this router's mean.
        if self._peer_load:
            said = self._peers_on()
            theirs = {ep.id: said.get(ep.id, (0, 0.0)) for ep in candidates}
        else:
            theirs = {ep.id: (n := others_of(ep), n * self._mean_load) for ep in candidates}
        busy = {ep.id: ep.outstanding + theirs[ep.id][0] for ep in candidates}
        home = max(candidates, key=lambda ep: zlib.crc32(ep.id.encode(), key.anchor))
        best, best_rank, matched = None, None, 0
        seen = [] if _log.debugging else None
        for ep in candidates:
            m = self.match(ep.id, key)
            uncached = self._uncached(key, m, cpt)
            if ep is not home and ep.id != sticky:  # one block's worth: near equals
                uncached += per_block
            work = self.inflight(ep.id) + theirs[ep.id][1]
            rank = (uncached + self.alpha * work, ep.id != sticky, busy[ep.id])
            if best_rank is None or rank < best_rank:
                best, best_rank, matched = ep, rank, m
            if seen is not None:
                seen.append(
                    f"{ep.id}:matched={m},uncached={uncached:.0f},work={work:.0f},"
                    f"own={ep.outstanding},others={busy[ep.id] - ep.outstanding}"
                    + (",home" if ep is home else "")
                )
        least = min(candidates, key=lambda ep: busy[ep.id])
        most = max(busy.values())
        slots = max((slots_of(ep) for ep in candidates), default=0)
        limit = max(2, slots)
        if (
            most - busy[least.id] > limit
            and most > 1.5 * busy[least.id]
            and busy[best.id] > busy[least.id]
        ):
            there = self.match(least.id, key)
            if self._may_move(best.id, key, matched, there, per_block, busy[best.id],
                              busy[least.id] + limit):  # fmt: skip
                best, matched = least, there
                if seen is not None:
                    seen.append("load-guard")
            elif seen is not None:
                seen.append("load-guard-stays")
        if self.hold_s > 0:
            key.holder = self._holder(best.id, key, matched, per_block)
        if seen is not None and key.holder is not None:
            seen.append("hold")
        if seen is not None:  # why it went there: `[log] level = "debug"`
            _log.debug(
                "prefix chose",
                replica=best.id,
                blocks=len(key.blocks),
                chars=key.chars,
                crc=key.crc,
                anchor=key.anchor,
                candidates=" ".join(seen),
            )
        self.sent(best.id, key, matched)
        return best

    def _may_move(self, rid: str, key: Key, matched: int, there: int, per_block: float,
                  busy: int, limit: float) -> bool:  # fmt: skip
        """Whether the load guard may take `key` off replica `rid`, which holds its first
        `matched` blocks, to one that holds `there` of them. Yes when that costs fewer
        than HOLD_MIN_TOKENS evaluated again. Else only when the requests in flight on
        `rid` that share what the other lacks are themselves more than `limit`: one hot
        prompt fills `rid`, and the move puts it on the other replica for good. Not when
        `rid` is busy with several prompts: their queue drains by itself as their
        conversations end, and a move would evaluate a whole prompt again (two of the
        six colds a run in bench/ROUTING-RUNS.md, run 42). This router's own requests
        there tell the share; other routers' are counted at that share."""
        if (matched - there) * per_block < HOLD_MIN_TOKENS:
            return True
        r = self._replicas.get(rid)
        if r is None or not r.requests:
            return True  # none of its own there: nothing tells the prompts apart
        sharing = r.using.get(key.blocks[there], 0)
        return sharing * busy / r.requests > limit

    def _holder(self, rid: str, key: Key, matched: int, per_block: float) -> Key | None:
        """The request in flight on `rid` that added the most of `key`'s first
        `matched` blocks, when they are worth waiting for."""
        pending = self._replicas[rid].pending if rid in self._replicas else None
        if not pending:
            return None
        count: dict = {}
        for h in key.blocks[:matched]:
            k = pending.get(h)
            if k is not None and not k.ended:
                count[k] = count.get(k, 0) + 1
        if not count:
            return None
        holder, n = max(count.items(), key=lambda kv: kv[1])
        return holder if n * per_block >= HOLD_MIN_TOKENS else None

    def _uncached(self, key: Key, matched: int, cpt: float) -> float:
        """Tokens of `key`'s prompt past its first `matched` blocks."""
        return max(0.0, (key.chars - matched * self.block_chars) / cpt)

    def sent(self, replica: str, key: Key, matched: int) -> None:
        """`key` went to `replica`: after it, the engine holds its prompt; until it
        ends, its uncached prompt and its decode count as work in flight there, and the
        blocks it adds are pending there (see HOLD_MIN_TOKENS)."""
        r = self._replica(replica)
        cpt = self.chars_per_token(key.model)
        key.matched = matched
        key.ended, key.answered_at = False, 0.0
        shared = min(matched, max(1, int(MISS_MIN_TOKENS * cpt / self.block_chars)))
        key.contended = matched > 0 and r.using.get(key.blocks[shared - 1], 0) > 0
        using = r.using
        for h in key.blocks:
            using[h] = using.get(h, 0) + 1
        decode = key.max_tokens * self.decode_weight(key.model)
        key.load = self._uncached(key, matched, cpt) + decode
        r.inflight += key.load
        r.requests += 1
        mean = self._mean_load
        self._mean_load = 0.9 * mean + 0.1 * key.load if mean else key.load
        self._hold(r, key.blocks, key)
        if self.on_change is not None:
            self.on_change(replica, r.requests, r.inflight, key.blocks)
        if key.session:
            self._sessions[key.session] = replica
            if len(self._sessions) > 100_000:
                del self._sessions[next(iter(self._sessions))]

    def _peers_on(self) -> dict:
        """Per replica, (requests, tokens of work) the peers said they have in flight."""
        out: dict = {}
        for (_, replica), (n, work) in self._peer_load.items():
            m, w = out.get(replica, (0, 0.0))
            out[replica] = (m + n, w + work)
        return out

    def learn(self, peer: str, replica: str | None, requests: int, work: float, blocks=()) -> None:
        """Another router (share.py) has `requests` and `work` in flight on `replica`
        now, and (with blocks) sent a prompt with these blocks there: the replica holds
        them. `replica` None: the peer went silent, its work no longer counts."""
        if replica is None:
            for k in [k for k in self._peer_load if k[0] == peer]:
                del self._peer_load[k]
            return
        if not replica or (self._table is not None and replica not in self._table):
            return  # a heartbeat, or not a replica of this router's table (or not yet)
        self._peer_load[(peer, replica)] = (requests, work)
        if blocks:
            self._hold(self._replica(replica), blocks)

    def loads(self) -> dict[str, tuple[int, float]]:
        """This router's requests and tokens of work in flight, per replica."""
        return {rid: (r.requests, r.inflight) for rid, r in self._replicas.items()}

    def _hold(self, r: _Replica, blocks, owner: Key | None = None) -> None:
        """The replica holds these blocks now: most recently used, the LRU trimmed;
        those new there pending on `owner` until it ends."""
        for h in blocks:
            if h in r.blocks:
                r.blocks.move_to_end(h)
            else:
                r.blocks[h] = None
                self._entries += 1
                if owner is not None:
                    r.pending[h] = owner
        self._trim(r)

    def _trim(self, r: _Replica) -> None:
        while len(r.blocks) > r.capacity:
            r.blocks.popitem(last=False)
            self._entries -= 1
        ceiling = max(1, self.memory_bytes // ENTRY_BYTES)
        while self._entries > ceiling:  # from whichever replica remembers most
            big = max(self._replicas.values(), key=lambda x: len(x.blocks))
            big.blocks.popitem(last=False)
            self._entries -= 1

    # -- what the engine said ---------------------------------------------------------

    def served(self, replica: str, key: Key, prompt_tokens: int, cached: int | None,
               decode_weight: float | None = None) -> Outcome:  # fmt: skip
        """The request sent with `sent()` ended. With the engine's prompt token count,
        learn the model's characters per token; with its timings, what a decoded token
        costs against a prompt token; with its cached count, drop the part of the chain
        it had not kept, when it kept far less than predicted."""
        if decode_weight is not None:
            w = min(DECODE_WEIGHT_MAX, max(1.0, decode_weight))
            old = self._decode_weight.get(key.model)
            self._decode_weight[key.model] = w if old is None else 0.8 * old + 0.2 * w
        r = self._replicas.get(replica)
        key.ended = True
        notify(key)
        if r is not None:
            if r.pending:
                for h in key.blocks:
                    if r.pending.get(h) is key:
                        del r.pending[h]
            using = r.using
            for h in key.blocks:
                n = using.get(h, 0)
                if n > 1:
                    using[h] = n - 1
                else:
                    using.pop(h, None)
            r.inflight = max(0.0, r.inflight - key.load)
            r.requests = max(0, r.requests - 1)
            if self.on_change is not None:
                self.on_change(replica, r.requests, r.inflight, ())
        key.load = 0.0
        if prompt_tokens > 0 and key.chars > 0:
            old = self.chars_per_token(key.model)
            self._chars_per_token[key.model] = 0.8 * old + 0.2 * (key.chars / prompt_tokens)
        cpt = key.chars / prompt_tokens if prompt_tokens > 0 else self.chars_per_token(key.model)
        predicted = min(key.matched * self.block_chars / cpt, float(prompt_tokens or 1e18))
        if cached is None or r is None:
            return Outcome(predicted, -1 if cached is None else cached, 0)
        dropped = 0
        missed = predicted - cached >= MISS_MIN_TOKENS and cached < 0.5 * predicted
        if missed and not key.contended:
            keep = int(cached * cpt / self.block_chars)
            for h in key.blocks[keep:]:
                if h in r.blocks:
                    del r.blocks[h]
                    self._entries -= 1
                    dropped += 1
        if _log.debugging:
            _log.debug("prefix served", replica=replica, crc=key.crc, prompt=prompt_tokens,
                       predicted=round(predicted), cached=cached, dropped=dropped,
                       contended=key.contended)  # fmt: skip
        return Outcome(predicted, cached, dropped)


def notify(key: Key) -> None:
    """Wake what waits on `key` (hold()): it began answering, or ended."""
    ev, key.progress = key.progress, None
    if ev is not None:
        ev.set()


def answered(key: Key, now: float) -> None:
    """The engine began answering `key`'s attempt: its prompt is evaluated."""
    if not key.answered_at:
        key.answered_at = now
        notify(key)


async def hold(key: Key, max_s: float) -> float:
    """Wait for `key.holder` (set by choose()) to end, so its engine has the prompt
    cached: at most `max_s`, and HOLD_GRACE; seconds waited."""
    h, key.holder = key.holder, None
    if h is None or h.ended:
        return 0.0
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + max_s
    while not h.ended:
        if h.answered_at:
            grace = HOLD_GRACE * max(0.0, h.answered_at - h.sent_at)
            deadline = min(deadline, h.answered_at + grace)
        left = deadline - loop.time()
        if left <= 0:
            break
        if h.progress is None:
            h.progress = asyncio.Event()
        try:
            await asyncio.wait_for(h.progress.wait(), left)
        except TimeoutError:
            break
    return loop.time() - start


def decode_weight(answer: dict) -> float | None:
    """ms per decoded token over ms per prompt token, from llama-server's `timings`;
    None when the answer has no such figures (other engines, a prompt all cached)."""
    timings = answer.get("timings")
    if not isinstance(timings, dict):
        return None
    prompt, decode = timings.get("prompt_per_token_ms"), timings.get("predicted_per_token_ms")
    if not isinstance(prompt, int | float) or not isinstance(decode, int | float):
        return None
    if prompt <= 0 or decode <= 0 or timings.get("prompt_n", 0) < 8:
        return None
    return decode / prompt


def cached_tokens(answer: dict) -> int | None:
    """Prompt tokens the engine reused from its cache, from an answer or a stream's
    last event: OpenAI's `usage.prompt_tokens_details.cached_tokens`, else
    llama-server's `timings.cache_n`; None when it says neither."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return details["cached_tokens"]
    timings = answer.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]
    return None
