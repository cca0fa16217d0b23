"""Sampling with speculation: the target's distributions, the random draws, the verify rule.

``target_probs`` defines the distribution a request samples from (temperature, then top-k, then
top-p, as in transformers' ``generate``); ``SpeculativeSampler`` holds a request's settings and
draws its random numbers; ``verify.py`` verifies a round's draft against that distribution with
the rejection-sampling kernel, so that the emitted tokens follow it exactly, whatever was
drafted.

Each request owns its random generator, seeded from the request's ``seed``: its draws depend on
nothing but its own rounds, so a seeded request gives the same text whatever else is in flight.
"""

from __future__ import annotations

import os

import torch


class InvalidDistributionError(RuntimeError):
    """The target produced a row that is not a distribution (NaN, inf, negative or no mass)."""


def target_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                 top_p: float = 1.0) -> torch.Tensor:
    """Sampling distributions [R, V] (fp32) from logits [R, V].

    top_k keeps the tokens whose logit reaches the k-th largest (ties at the edge are kept);
    top_p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one).
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling (0 means greedy)")
    scaled = logits.float() / temperature  # [R, V]
    if top_k is not None and 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [R, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float, head: int = 1024) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches top_p.

    Sorting a 262k-token row is slow on a CPU and a nucleus is usually small, so the rows are
    first cut to their ``head`` most likely tokens; only rows whose head holds less than top_p
    of the mass are sorted in full. Both give the same set.
    """
    head = min(head, probs.shape[-1])
    top_probs, order = torch.topk(probs, head, dim=-1)  # [R, head], descending
    if bool((top_probs.sum(dim=-1) < top_p).any()):
        top_probs, order = torch.sort(probs, dim=-1, descending=True)  # [R, V]
    mass_before = torch.cumsum(top_probs, dim=-1) - top_probs
    dropped = mass_before >= top_p
    # The most likely token always stays: a top_p below float32's range (1e-300) compares as 0,
    # which would otherwise drop every token and leave no distribution.
    dropped[:, 0] = False
    kept = top_probs.masked_fill(dropped, 0.0)
    nucleus = torch.zeros_like(probs).scatter_(-1, order, kept)  # [R, V]
    return nucleus / nucleus.sum(dim=-1, keepdim=True)


def new_seed() -> int:
    """A fresh seed for requests that give none (from the OS, not torch's global generator)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


class SpeculativeSampler:
    """One request's sampling settings and random generator."""

    def __init__(self, temperature: float, top_k: int | None = None, top_p: float = 1.0,
                 seed: int | None = None, device: torch.device | str = "cpu"):
        if temperature <= 0:
            raise ValueError("temperature must be > 0 for sampling (0 means greedy)")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed = new_seed() if seed is None else seed
        self.generator = torch.Generator(device=device)
        # Seeds are 64-bit (OpenAI's range is signed or unsigned): taken modulo 2**64, which
        # manual_seed accepts whole.
        self.generator.manual_seed(self.seed % 2**64)

    def draws(self, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One round's random numbers: uniform [k] for the acceptance tests, then Exp(1) noise
        [vocab] for the one sampled token. Always in this order and amount for a round of k
        drafts, so a seed replays the same request."""
        device = self.generator.device
        uniform = torch.rand(k, generator=self.generator, device=device)  # [k]
        exp_noise = torch.empty(vocab, device=device).exponential_(generator=self.generator)  # [vocab]
        return uniform, exp_noise
