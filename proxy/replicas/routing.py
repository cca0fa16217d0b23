"""Which replica answers a request: the hint and the policy, no Ray (``routers.py`` plugs them
into Serve).

A replica's engine keeps the KV blocks of earlier prompts (its prefix cache, 16-token blocks). A
request whose leading blocks another request already filled on replica R is cheaper on R: its
``cached_tokens`` say how much. So a prompt's leading blocks are hashed as a chain (block i's hash
covers blocks 0..i, as the engine's prefix cache keys them), the router remembers which replica
last took each hash, and sends a request to the replica holding its longest chain while the load
is even. A replica more than ``imbalance`` requests busier than the least busy sheds to it."""

from __future__ import annotations

import logging
import random
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.prompts import CUT_SLACK, PREFIX_CHARS_PER_TOKEN, chat_prompt, prompt_ids
from foretell.proxy.server.schema import ChatCompletionRequest, CompletionRequest, validate
from foretell.proxy.server.tool_calls.format import tool_plan

log = logging.getLogger("foretell.ingress")

# The engine's KV-cache block (SpeculativeEngine's block_size; a replica reports its own): only
# whole blocks are reused.
BLOCK_SIZE = 16
# Leading blocks hashed per request: enough to tell long shared prefixes apart (1,024 tokens).
MAX_BLOCKS = 64
GENERATION_PATHS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
# The Serve routers of this process (``routers.py``), where the ingress reads the replicas'
# reported stats. Kept here, not in routers.py: Serve ships a router class to the ingress
# pickled by value, with a private copy of its own module's globals.
LIVE_ROUTERS: weakref.WeakSet = weakref.WeakSet()
_RNG = random.Random()


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE,
                 max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained hashes of the whole leading blocks of ``token_ids`` (a partial last block is
    not hashed: the engine does not reuse it either)."""
    hashes, previous = [], 0
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        hashes.append(previous)
    return hashes


def prompt_hint(tokenizer, path: str, body: dict, block_size: int = BLOCK_SIZE) -> list[int]:
    """The block hashes of a generation request's leading prompt tokens, as a replica will
    tokenise them; none for a request that does not validate (its replica answers the error)."""
    try:
        parsed = validate(GENERATION_PATHS[path], body)
        if path == "/v1/chat/completions":
            text = chat_prompt(tokenizer, parsed.messages, tool_plan(body))  # the tools lead the prompt
        else:
            text = parsed.prompt
            if isinstance(text, list) and text and not isinstance(text[0], int):
                text = text[0]  # a list of one prompt
            if isinstance(text, list):
                return block_hashes(text, block_size)  # token ids, used as sent
        # Only the start is tokenised: no token spans more than PREFIX_CHARS_PER_TOKEN characters,
        # so the cut text holds every hashed block whole, and the cut (which may change the tokens
        # beside it) lies past them.
        cut = PREFIX_CHARS_PER_TOKEN * (block_size * MAX_BLOCKS + CUT_SLACK)
        return block_hashes(prompt_ids(tokenizer, text[:cut], None, param="prompt",
                                       special=parsed.add_special_tokens), block_size)
    except (APIError, ValueError, TypeError, KeyError, IndexError) as error:
        log.debug("no routing hint: %s", error)
        return []


class AffinityTable:
    """Which replica last took each block hash (the most recent ``capacity`` hashes)."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self.owner: OrderedDict[int, Hashable] = OrderedDict()
        self.held: dict[Hashable, int] = {}  # hashes each replica owns, to spread new prefixes

    def match(self, hashes: Sequence[int]) -> tuple[Hashable | None, int]:
        """The replica holding the longest chain of ``hashes``, and its length in blocks."""
        for depth in range(len(hashes), 0, -1):
            replica = self.owner.get(hashes[depth - 1])
            if replica is not None:
                return replica, depth
        return None, 0

    def record(self, hashes: Sequence[int], replica: Hashable) -> None:
        for value in hashes:
            previous = self.owner.pop(value, None)
            if previous is not None:
                self.held[previous] -= 1
            self.owner[value] = replica
            self.held[replica] = self.held.get(replica, 0) + 1
        while len(self.owner) > self.capacity:
            _, evicted = self.owner.popitem(last=False)
            self.held[evicted] -= 1

    def forget(self, replica: Hashable) -> None:
        """A replica that left (died, scaled down): its cache went with it."""
        for value in [value for value, owner in self.owner.items() if owner == replica]:
            del self.owner[value]
        self.held.pop(replica, None)


def rank_by_affinity(table: AffinityTable, hashes: Sequence[int], loads: dict[Hashable, int],
                     imbalance: int, rng: random.Random = _RNG) -> list[list[Hashable]]:
    """Replicas in order of preference (each inner list one rank) for a request with these
    block ``hashes``, given each candidate's ongoing requests in ``loads``.

    The replica with the longest cached chain comes first unless it is more than ``imbalance``
    requests busier than the least busy; otherwise (no match, or overloaded) the least busy
    first, ties going to the replica holding the fewest hashes, so new prefixes spread out, and
    remaining ties (short prompts, no hashes) to any one of them at random."""
    least = min(loads.values())
    owner, _ = table.match(hashes)
    by_load = sorted(loads, key=lambda r: (loads[r], table.held.get(r, 0), rng.random()))
    if owner in loads and loads[owner] - least <= imbalance:
        return [[owner], [r for r in by_load if r != owner]]
    return [[by_load[0]], by_load[1:]] if len(by_load) > 1 else [by_load]


class RoundRobin:
    """Each replica in turn (in a stable order), whatever the prompt: the baseline."""

    def __init__(self):
        self.turn = 0

    def rank(self, replicas: Sequence[Hashable]) -> list[list[Hashable]]:
        ordered = sorted(replicas, key=str)
        first = ordered[self.turn % len(ordered)]
        self.turn += 1
        return [[first], [r for r in ordered if r != first]]
