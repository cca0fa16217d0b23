"""Gemma 3's decoder layer as one function: the same tensor operations as transformers' module
tree, in the same order, without its ~20 nested module calls, keyword plumbing and decorators a
layer.

Why: in the int8 precision a plain step of the embedded model is ~21 ms on a 2-core Zen 4, of
which ~12 ms are kernels (FBGEMM's products, the native attention, norms and quantization) and the
rest Python around ~1,900 small tensor operations; calling the layer's parts directly measured
~1 ms a step less (docs/benchmarks.md). Only the Python around the operations changes, so the
bits must not: ``use_lean_layers`` runs a probe prefill and a decoding pass through the engine's
own cache with the layers as they are and again with this function, and keeps it only where
every logit is the same bit for bit (a transformers version whose Gemma 3 layer computes
otherwise keeps its own code, with a warning). Any other family keeps transformers' layers.
"""

from __future__ import annotations

import logging
import types

import torch

from foretell.proxy.engine.forward import forward_pass
from foretell.proxy.engine.kv_cache import PagedKVCache, paged_attention

log = logging.getLogger("foretell.engine")
PROBE_TOKENS = 11  # a prefill of this many tokens (a masked pass), then a one-row decoding pass


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def gemma3_layer_forward(layer, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                         cache=None, **kwargs):
    """A transformers ``Gemma3DecoderLayer``'s forward as one function, bound to the layer as its
    ``forward`` (a bound method, so a deep copy of the model binds the copy); through any cache
    other than foretell's paged one it defers to the layer's own code."""
    if not isinstance(cache, PagedKVCache):
        return type(layer).forward(layer, hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, position_ids=position_ids, cache=cache, **kwargs)
    attention, mlp = layer.self_attn, layer.mlp
    residual = hidden_states  # [1, T, hidden]
    x = layer.input_layernorm.forward(hidden_states)
    shape = (*x.shape[:-1], -1, attention.head_dim)
    query = attention.q_proj.forward(x).view(shape).transpose(1, 2)  # [1, heads, T, head_dim]
    key = attention.k_proj.forward(x).view(shape).transpose(1, 2)  # [1, kv_heads, T, head_dim]
    value = attention.v_proj.forward(x).view(shape).transpose(1, 2)
    query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
    cos, sin = (part.unsqueeze(1) for part in position_embeddings)  # [1, 1, T, head_dim]
    query = (query * cos) + (_rotate_half(query) * sin)
    key = (key * cos) + (_rotate_half(key) * sin)
    cache.update(key, value, attention.layer_idx)
    out, _ = paged_attention(attention, query, key, value, attention_mask, scaling=attention.scaling,
                             foretell_cache=cache)  # [1, T, heads, head_dim]
    out = attention.o_proj.forward(out.reshape(*x.shape[:-1], -1).contiguous())
    hidden_states = residual + layer.post_attention_layernorm.forward(out)
    residual = hidden_states
    x = layer.pre_feedforward_layernorm.forward(hidden_states)
    x = mlp.down_proj.forward(mlp.act_fn.forward(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
    return residual + layer.post_feedforward_layernorm.forward(x)


def _gemma3_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "Gemma3DecoderLayer"]


def _probe(model, cache: PagedKVCache, fp32_head: bool) -> list[torch.Tensor]:
    """The logits of a prefill of PROBE_TOKENS tokens and of one decoding row after it."""
    ids = torch.randint(10, min(1000, model.config.vocab_size), (PROBE_TOKENS + 1,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    blocks = cache.reserve(len(ids), len(ids))
    if blocks is None:
        return []
    try:
        prefill = forward_pass(model, cache, [(blocks, ids[:-1], 0)], fp32_head)
        blocks.committed = len(ids) - 1
        return [prefill, forward_pass(model, cache, [(blocks, ids[-1:], 0)], fp32_head)]
    finally:
        cache.free(blocks)


@torch.inference_mode()
def use_lean_layers(model, cache: PagedKVCache, fp32_head: bool) -> bool:
    """Give ``model``'s Gemma 3 decoder layers ``gemma3_layer_forward`` where it computes their
    bits (checked once per model); whether they have it."""
    decided = getattr(model, "foretell_lean_layers", None)
    if decided is not None:
        return decided
    layers = _gemma3_layers(model)
    lean = False
    if layers:
        reference = _probe(model, cache, fp32_head)
        for layer in layers:
            layer.forward = types.MethodType(gemma3_layer_forward, layer)
        probe = _probe(model, cache, fp32_head)
        lean = bool(reference) and all(torch.equal(a, b) for a, b in zip(reference, probe))
        if not lean:
            for layer in layers:
                del layer.forward  # the class's own again
            log.warning("the one-function Gemma 3 layer computes otherwise than this transformers "
                        "version's; its own layers serve")
    model.foretell_lean_layers = lean
    return lean
