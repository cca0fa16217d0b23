"""The engine's own KV cache: preallocated, position-indexed, in blocks, shared by every sequence.

Why not transformers' ``DynamicCache`` or ``continuous_batching.PagedAttentionCache`` (see
docs/batching.md): one ``DynamicCache`` per request cannot share a pass between requests, and the
paged cache's sliding-window allocator is a ring of exactly ``window`` slots, so verifying a draft
overwrites entries that a rollback needs again, and it refuses prefix sharing for models with
sliding layers (Gemma 3). Here:

- Layers are grouped by attention type (full / sliding). Each group has its own pool of blocks of
  ``block_size`` positions; a sequence holds one block table per group.
- A pass writes the K/V of every new position at its slot (``block * block_size + offset``) and
  each sequence's queries attend to its own positions read back through its block tables.
  Rollback is free: a sequence's committed length simply does not advance past what was
  accepted, and the rejected slots are overwritten by the next pass.
- Sliding layers keep only their window: blocks wholly behind the window are released after
  every step (``release_behind_window``).
- Blocks of a prompt prefix are registered in a prefix cache when they are complete, keyed by
  their exact tokens and their parent entry, so a later request with the same prefix reuses them;
  entries nobody uses are evicted least-recently-used when a pool runs dry.

The model runs through a registered attention function (``foretell_paged``) that reads the
step's layout (``StepLayout``) from this cache; positions are passed explicitly, so the model's
own masks and cache bookkeeping are bypassed. Two ways to attend, chosen by the engine
(``kernel_choice.py``): a loop over the step's sequences, each gathering its keys and calling
``scaled_dot_product_attention`` (the CPU path and the oracle), or one ragged paged attention
kernel per layer that reads the keys in place through the block tables
(``foretell.kernels.paged_attention``; ``attention_kernel`` set).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from foretell.kernels.paged_attention import block_q_for, query_tiles
from foretell.kernels.row_attention import HEAD_SIZE_STEP, native_row_attention
from foretell.proxy.engine.invariant_attention import fixed_split_attention, key_span

FULL, SLIDING = "full_attention", "sliding_attention"
ATTENTION_NAME = "foretell_paged"


class CacheFullError(ValueError):
    """A request can never fit in the configured cache."""


class BlockPool:
    """Free list and reference counts of one group's blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * num_blocks

    def take(self) -> int | None:
        if not self.free:
            return None
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)


@dataclass
class PrefixEntry:
    """One cached, complete prompt block: its blocks in each group (None: released)."""

    id: int
    key: tuple  # (parent entry id, the block's tokens)
    blocks: dict[str, int | None]


@dataclass
class SequenceBlocks:
    """One sequence's block tables (per group) and how many of its positions hold valid K/V."""

    tables: dict[str, list[int | None]]
    committed: int = 0  # positions [0, committed) hold accepted K/V
    registered: int = 0  # leading blocks already in the prefix cache (or taken from it)
    last_entry: int = -1  # id of the prefix entry of block registered - 1 (-1: the root)
    reserved: dict[str, int] = field(default_factory=dict)  # blocks promised but not yet taken


@dataclass
class StepLayout:
    """Where one pass's tokens go and what each sequence's queries read.

    For sequence i: its queries are rows ``query_starts[i] : query_starts[i+1]`` of the flattened
    batch; per group, ``read_slots[group][i]`` are the slots of the keys it attends to (positions
    ``key_first[group][i] ..`` up to its last query) and ``masks[group][i]`` the [q, keys] boolean
    mask (causal, plus the window on sliding layers).
    """

    query_starts: list[int]
    write_slots: dict[str, torch.Tensor]  # [T] per group
    read_slots: dict[str, list[torch.Tensor]]  # the loop's (empty when the kernel attends)
    masks: dict[str, list[torch.Tensor | None]]
    kernel: KernelLayout | None = None  # the kernel's (None when the loop attends)


@dataclass
class KernelLayout:
    """One step as the ragged paged attention kernel reads it, on the device; built once per
    step and shared by every layer (``foretell.kernels.paged_attention`` for the layout)."""

    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B] positions held once this step's are written
    block_tables: dict[str, torch.Tensor]  # int32 [B, max_blocks] per group, -1: not held
    tiles: tuple[torch.Tensor, torch.Tensor]  # the kernel's grid (query_tiles)
    block_q: int


class PagedKVCache:
    """K/V pools for every layer of ``model`` and the block bookkeeping of every sequence."""

    def __init__(self, model, max_tokens: int, block_size: int = 16, sliding_tokens: int | None = None):
        config = model.config
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit soft-capping is not supported by the paged cache")
        self.block_size = block_size
        self.layer_types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
        self.window = getattr(config, "sliding_window", None) if SLIDING in self.layer_types else None
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, heads, head_dim
        # The ragged paged attention kernel, or None: the per-sequence loop (set by the engine).
        self.attention_kernel: Callable | None = None
        # The loop attends in a fixed order, set by the engine for a batch-invariant precision:
        # the native loop on a float32 CPU cache (foretell.kernels.row_attention), else the torch
        # operations of invariant_attention.py.
        self._batch_invariant = False
        self.row_attention: Callable | None = None
        self.max_tokens = max_tokens
        blocks = {FULL: math.ceil(max_tokens / block_size)}
        if self.window is not None:
            blocks[SLIDING] = math.ceil((sliding_tokens or max_tokens) / block_size)
        self.groups = [g for g in (FULL, SLIDING) if g in self.layer_types]
        self.pools = {g: BlockPool(blocks[g]) for g in self.groups}
        # One K and one V tensor per layer: [kv_heads, blocks * block_size, head_dim], the model's
        # own layout, so writes need no transpose and a gather along dim 1 is contiguous.
        self.keys, self.values = [], []
        for layer_type in self.layer_types:
            slots = blocks[layer_type] * block_size
            self.keys.append(torch.zeros(heads, slots, head_dim, device=self.device, dtype=self.dtype))
            self.values.append(torch.zeros(heads, slots, head_dim, device=self.device, dtype=self.dtype))
        self.bytes = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        self.prefix: OrderedDict[tuple, PrefixEntry] = OrderedDict()  # LRU order, oldest first
        self._promised = {g: 0 for g in self.groups}  # blocks reserved but not yet taken
        self._entry_ids = 0
        self.layout: StepLayout | None = None
        self.hits = self.lookups = 0  # prompt tokens found in / looked up in the prefix cache
        self.evictions = 0  # prefix entries dropped to make room

    @property
    def batch_invariant(self) -> bool:
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = on
        native = (on and self.dtype == torch.float32 and self.device.type == "cpu"
                  and self.head_dim % HEAD_SIZE_STEP == 0)
        self.row_attention = native_row_attention() if native else None

    # ---- capacity ------------------------------------------------------------------------

    def blocks_for(self, group: str, positions: int, max_query: int) -> int:
        """Blocks one sequence of ``positions`` positions can hold at once in ``group``."""
        if group == SLIDING:
            positions = min(positions, self.window - 1 + max_query + self.block_size)
        return math.ceil(positions / self.block_size) + 1

    def _available(self, group: str) -> int:
        pool = self.pools[group]
        evictable = sum(1 for e in self.prefix.values()
                        if e.blocks.get(group) is not None and pool.refs[e.blocks[group]] == 1)
        return len(pool.free) + evictable - self._promised[group]

    def usage(self) -> float:
        """Fraction of full-attention blocks held by sequences or the prefix cache."""
        pool = self.pools[FULL]
        return 1.0 - len(pool.free) / pool.num_blocks

    def check_fits(self, positions: int, max_query: int) -> None:
        """Refuse a sequence that could never fit, even in an empty cache."""
        for group in self.groups:
            need = self.blocks_for(group, positions, max_query)
            if need > self.pools[group].num_blocks:
                raise CacheFullError(
                    f"the request needs {positions} tokens of KV cache; the cache holds "
                    f"{self.max_tokens} (raise --kv-cache-tokens)")

    def reserve(self, positions: int, max_query: int) -> SequenceBlocks | None:
        """Promise a new sequence every block it may need, or None when they are not free now."""
        need = {g: self.blocks_for(g, positions, max_query) for g in self.groups}
        if any(need[g] > self._available(g) for g in self.groups):
            return None
        for g in self.groups:
            self._promised[g] += need[g]
        return SequenceBlocks(tables={g: [] for g in self.groups}, reserved=need)

    def free(self, seq: SequenceBlocks) -> None:
        """Give back a finished or cancelled sequence's blocks and its unused promise."""
        for g in self.groups:
            for block in seq.tables[g]:
                if block is not None:
                    self.pools[g].release(block)
            seq.tables[g] = []
            self._promised[g] -= seq.reserved.get(g, 0)
            seq.reserved[g] = 0

    def _take(self, group: str, seq: SequenceBlocks) -> int:
        pool = self.pools[group]
        block = pool.take()
        while block is None:
            self._evict_one(group)
            block = pool.take()
        if seq.reserved.get(group, 0) > 0:
            seq.reserved[group] -= 1
            self._promised[group] -= 1
        return block

    def _evict_one(self, group: str) -> None:
        for key, entry in self.prefix.items():  # oldest first
            block = entry.blocks.get(group)
            if block is not None and self.pools[group].refs[block] == 1:
                del self.prefix[key]
                self.evictions += 1
                for g, b in entry.blocks.items():
                    if b is not None:
                        self.pools[g].release(b)
                return
        raise RuntimeError(f"KV cache exhausted in the {group} group despite the reservation")

    # ---- prefix reuse --------------------------------------------------------------------

    def match_prefix(self, seq: SequenceBlocks, prompt: list[int]) -> int:
        """Reuse cached blocks for the longest prefix of ``prompt`` (never its last token, which
        is fed to produce the first logits). Returns the number of positions reused."""
        bs = self.block_size
        usable = (len(prompt) - 1) // bs
        chain: list[PrefixEntry] = []
        parent = -1
        for index in range(usable):
            entry = self.prefix.get((parent, tuple(prompt[index * bs:(index + 1) * bs])))
            if entry is None or entry.blocks[FULL] is None:
                break
            chain.append(entry)
            parent = entry.id
        # Sliding layers need the blocks of the last window before the reuse point.
        while chain and self.window is not None:
            end = len(chain) * bs
            first = max(0, end - self.window + 1) // bs
            if all(e.blocks.get(SLIDING) is not None for e in chain[first:]):
                break
            chain.pop()
        self.lookups += max(len(prompt) - 1, 0)
        if not chain:
            return 0
        end = len(chain) * bs
        first_sliding = max(0, end - self.window + 1) // bs if self.window is not None else 0
        for index, entry in enumerate(chain):
            for g in self.groups:
                if g == SLIDING and index < first_sliding:
                    seq.tables[g].append(None)
                    continue
                block = entry.blocks[g]
                self.pools[g].share(block)
                seq.tables[g].append(block)
                if seq.reserved.get(g, 0) > 0:
                    seq.reserved[g] -= 1
                    self._promised[g] -= 1
        for entry in reversed(chain):  # the first block ends up most recently used
            self.prefix.move_to_end(entry.key)
        seq.committed = end
        seq.registered = len(chain)
        seq.last_entry = chain[-1].id
        self.hits += end
        return end

    def register_prompt_blocks(self, seq: SequenceBlocks, prompt: list[int]) -> None:
        """Put the sequence's complete, committed prompt blocks into the prefix cache."""
        bs = self.block_size
        complete = min(seq.committed, len(prompt)) // bs
        while seq.registered < complete:
            index = seq.registered
            key = (seq.last_entry, tuple(prompt[index * bs:(index + 1) * bs]))
            entry = self.prefix.get(key)
            if entry is None:
                self._entry_ids += 1
                entry = PrefixEntry(self._entry_ids, key, {g: seq.tables[g][index] for g in self.groups})
                for g, block in entry.blocks.items():
                    if block is not None:
                        self.pools[g].share(block)
                self.prefix[key] = entry
            self.prefix.move_to_end(key)
            seq.last_entry = entry.id
            seq.registered += 1

    # ---- a step --------------------------------------------------------------------------

    def release_behind_window(self, seq: SequenceBlocks) -> None:
        """Sliding layers: drop blocks no future query can see (all positions <= committed - window)."""
        if self.window is None:
            return
        table = seq.tables[SLIDING]
        behind = max(0, seq.committed - self.window + 1) // self.block_size
        for index in range(min(behind, len(table))):
            if table[index] is not None:
                self.pools[SLIDING].release(table[index])
                table[index] = None
                # The window moves on: the block is promised back to this sequence, which holds
                # at most its window's worth at once however long it runs.
                seq.reserved[SLIDING] = seq.reserved.get(SLIDING, 0) + 1
                self._promised[SLIDING] += 1

    def _slots(self, group: str, seq: SequenceBlocks, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end), taking blocks as needed."""
        bs, table = self.block_size, seq.tables[group]
        while len(table) * bs < end:
            table.append(self._take(group, seq))
        positions = torch.arange(start, end)
        blocks = torch.tensor([-1 if b is None else b for b in table], dtype=torch.long)
        slots = blocks[positions // bs] * bs + positions % bs
        assert bool((slots >= 0).all()), "a released sliding block was read"
        return slots.to(self.device)

    def plan(self, feeds: list[tuple[SequenceBlocks, int]]) -> StepLayout:
        """Lay out one pass: each (sequence, new positions) writes after its committed length."""
        query_starts, row = [0], 0
        write = {g: [] for g in self.groups}
        read = {g: [] for g in self.groups}
        masks = {g: [] for g in self.groups}
        kernel = self.attention_kernel is not None
        for seq, count in feeds:
            start, end = seq.committed, seq.committed + count
            q_pos = None if kernel else torch.arange(start, end, device=self.device)
            for g in self.groups:
                first = max(0, start - self.window + 1) if g == SLIDING else 0
                if kernel:  # the kernel finds the keys through the block tables
                    write[g].append(self._slots(g, seq, start, end))
                    # The kernel skips a released block silently; the loop's gather would fail.
                    assert g == FULL or None not in seq.tables[g][first // self.block_size:], \
                        "a released sliding block was read"
                    continue
                slots = self._slots(g, seq, first, end)
                write[g].append(slots[start - first:])
                if self.batch_invariant:  # whole chunks; the keys outside [first, end) masked
                    span_start, span_stop = key_span(first, end)
                    padded = torch.zeros(span_stop - span_start, dtype=slots.dtype, device=self.device)
                    padded[first - span_start:end - span_start] = slots
                    slots, first = padded, span_start
                    k_pos = torch.arange(span_start, span_stop, device=self.device)
                    visible = (k_pos.view(1, -1) <= q_pos.view(-1, 1)) & (k_pos.view(1, -1) < end)
                    if g == SLIDING:
                        visible &= k_pos.view(1, -1) > q_pos.view(-1, 1) - self.window
                    read[g].append(slots)
                    masks[g].append(visible)
                    continue
                read[g].append(slots)
                k_pos = torch.arange(first, end, device=self.device)
                visible = k_pos.view(1, -1) <= q_pos.view(-1, 1)  # [q, keys]
                if g == SLIDING:
                    visible &= k_pos.view(1, -1) > q_pos.view(-1, 1) - self.window
                masks[g].append(None if count == 1 else visible)  # one query sees all its keys
            row += count
            query_starts.append(row)
        self.layout = StepLayout(query_starts, {g: torch.cat(w) for g, w in write.items()}, read, masks,
                                 self._kernel_layout(feeds) if kernel else None)
        return self.layout

    def _kernel_layout(self, feeds: list[tuple[SequenceBlocks, int]]) -> KernelLayout:
        """The step's layout for the kernel, copied to the device at once (its tiles in a second copy)."""
        counts = [count for _, count in feeds]
        host = [list(itertools.accumulate(counts, initial=0)),
                [seq.committed + count for seq, count in feeds]]
        for g in self.groups:
            width = max(len(seq.tables[g]) for seq, _ in feeds)
            host.extend([-1 if b is None else b for b in seq.tables[g]] + [-1] * (width - len(seq.tables[g]))
                        for seq, _ in feeds)
        flat = torch.tensor(list(itertools.chain.from_iterable(host)), dtype=torch.int32).to(self.device)
        parts = flat.split([len(row) for row in host])
        B = len(feeds)
        tables = {g: torch.stack(parts[2 + i * B: 2 + (i + 1) * B]) for i, g in enumerate(self.groups)}
        block_q = block_q_for(counts, self.heads, self.kv_heads)
        return KernelLayout(parts[0], parts[1], tables, query_tiles(counts, block_q, self.device), block_q)

    # The model calls this for every layer (transformers' Cache protocol).
    def update(self, key_states, value_states, layer_idx: int, kwargs=None):
        group = self.layer_types[layer_idx]
        slots = self.layout.write_slots[group]
        # [1, kv_heads, T, head_dim] -> the slots of [kv_heads, slots, head_dim].
        self.keys[layer_idx][:, slots] = key_states[0]
        self.values[layer_idx][:, slots] = value_states[0]
        if kwargs is not None:
            kwargs["foretell_cache"] = self
        return key_states, value_states

    @contextlib.contextmanager
    def attached(self, model):
        """Route ``model``'s attention through this cache for the duration of one pass."""
        config = model.config
        saved = config._attn_implementation
        config._attn_implementation_internal = ATTENTION_NAME
        try:
            yield
        finally:
            config._attn_implementation_internal = saved
            self.layout = None


def paged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    foretell_cache: PagedKVCache | None = None, **kwargs):
    """Attention of every sequence's queries over its own cached keys.

    query: [1, heads, T, head_dim] for the flattened batch; returns [1, T, heads, head_dim].
    """
    cache = foretell_cache
    layout = cache.layout
    layer = module.layer_idx
    group = cache.layer_types[layer]
    keys, values = cache.keys[layer], cache.values[layer]  # [kv_heads, slots, head_dim]
    heads = query.shape[1]
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3],
                      device=query.device, dtype=query.dtype)  # [1, T, heads, head_dim]
    if layout.kernel is not None:  # one launch for every sequence of the step
        step = layout.kernel
        cache.attention_kernel(
            query[0].transpose(0, 1), keys, values, step.block_tables[group], step.query_start_loc,
            step.seq_lens, block_size=cache.block_size,
            scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
            window=cache.window if group == SLIDING else None, tiles=step.tiles, block_q=step.block_q,
            out=out[0])  # [T, heads, head_dim] views of [1, heads, T, head_dim] and the output
        return out, None
    starts = layout.query_starts
    if cache.batch_invariant:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        for i, slots in enumerate(layout.read_slots[group]):
            rows = slice(starts[i], starts[i + 1])
            if cache.row_attention is not None:  # the keys read where they lie, no gather
                cache.row_attention(query[0, :, rows], keys, values, slots, layout.masks[group][i], scale,
                                    out=out[0, rows])  # [q, heads, head_dim]
                continue
            out[0, rows] = fixed_split_attention(
                query[0, :, rows], keys.index_select(1, slots), values.index_select(1, slots),
                layout.masks[group][i], scale)  # [q, heads, head_dim]
        return out, None
    for i, slots in enumerate(layout.read_slots[group]):
        q = query[:, :, starts[i]:starts[i + 1]]  # [1, heads, q, head_dim]
        k = keys.index_select(1, slots)  # [kv_heads, keys, head_dim]
        v = values.index_select(1, slots)
        mask = layout.masks[group][i]  # [q, keys] or None
        o = F.scaled_dot_product_attention(q, _per_head(k, heads).unsqueeze(0), _per_head(v, heads).unsqueeze(0),
                                           attn_mask=mask, scale=scaling)  # [1, heads, q, head_dim]
        out[:, starts[i]:starts[i + 1]] = o.transpose(1, 2)
    return out, None


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[kv_heads, keys, head_dim] -> [heads, keys, head_dim] for grouped-query attention; with one
    KV head (Gemma 3 270M) a broadcast view, no copy."""
    kv_heads = x.shape[0]
    if kv_heads == heads:
        return x
    if kv_heads == 1:
        return x.expand(heads, *x.shape[1:])
    return x.repeat_interleave(heads // kv_heads, dim=0)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)


_register()
