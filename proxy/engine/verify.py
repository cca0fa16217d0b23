"""Verification of a whole step: every greedy sequence in one kernel launch, every sampled one in
another, and every result read back to the host in one transfer.

The pass's logits hold each verifying sequence's ``k + 1`` rows (after its pending token and
after each draft token). They are laid flat, vLLM's layout: ``rows [num_rows, V]``,
``drafts [num_draft_tokens]`` and ``cu_num_draft_tokens [B]`` (see ``foretell.kernels``).
Sampled sequences each bring their own distribution (temperature, top-k, top-p) and their own
seeded generator's draws, laid flat in the same order, so a seeded request draws the same
numbers whatever shares its step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from foretell.proxy.engine.sampling import InvalidDistributionError, SpeculativeSampler, target_probs


@dataclass
class VerifyRows:
    """One sequence's part of a step's verification."""

    first_row: int  # its first row in the pass's logits
    draft: list[int]
    sampler: SpeculativeSampler | None  # None: greedy
    # The draft distribution q [k, V] each draft token was drawn from (a draft model sampling);
    # None: point masses (drafts copied from text).
    draft_probs: torch.Tensor | None = None


Outcome = tuple[int, list[int]] | Exception  # (accepted drafts, new tokens), or what failed


def verify_step(kernels, logits: torch.Tensor, entries: list[VerifyRows]) -> list[Outcome]:
    """Verify every entry against ``logits`` [rows, V]; one outcome per entry, in order.

    ``kernels`` has ``greedy_verify`` and ``rejection_sample`` (``kernel_choice.Kernels``). An
    error of one kind's launch fails that kind's sequences; a row that is not a distribution
    fails its own sequence."""
    outcomes: list[Outcome | None] = [None] * len(entries)
    launched = []  # (indices, result tensors on the device)
    greedy = [i for i, e in enumerate(entries) if e.sampler is None]
    sampled = [i for i, e in enumerate(entries) if e.sampler is not None]
    for indices, launch in ((greedy, _launch_greedy), (sampled, _launch_sampled)):
        if not indices:
            continue
        try:
            launched.append((indices, launch(kernels, logits, [entries[i] for i in indices])))
        except Exception as error:  # these sequences fail; the other kind goes on
            for i in indices:
                outcomes[i] = error
    if launched:
        host = torch.cat([t.view(-1) for _, results in launched for t in results]).tolist()
        offset = 0
        for indices, results in launched:
            parts = []
            for t in results:
                parts.append(host[offset:offset + t.numel()])
                offset += t.numel()
            _read_back(indices, [entries[i] for i in indices], parts, outcomes)
    return outcomes


def _flat(logits: torch.Tensor, entries: list[VerifyRows]):
    """The entries' rows [num_rows, V] (a view when they lie in one run, as they do unless a
    step mixes kinds or holds prompt-logprob rows: a copy is 1 MB a row at V = 262k), drafts
    [N] and cu_num_draft_tokens [B]."""
    index = [row for e in entries for row in range(e.first_row, e.first_row + len(e.draft) + 1)]
    if index == list(range(index[0], index[0] + len(index))):
        rows = logits[index[0]:index[0] + len(index)]
    else:
        rows = logits[torch.tensor(index, device=logits.device)]
    drafts = [token for e in entries for token in e.draft]
    cu = list(itertools.accumulate(len(e.draft) for e in entries))
    host = torch.tensor(drafts + cu, dtype=torch.long).to(logits.device)  # one copy
    return rows, host[:len(drafts)], host[len(drafts):]


def _launch_greedy(kernels, logits, entries):
    rows, drafts, cu = _flat(logits, entries)
    return kernels.greedy_verify(rows, drafts, cu)  # (num_accepted [B], output_tokens [num_rows])


def _launch_sampled(kernels, logits, entries):
    rows, drafts, cu = _flat(logits, entries)
    probs, uniform, noise, row = [], [], [], 0
    for e in entries:
        k = len(e.draft)
        probs.append(target_probs(rows[row:row + k + 1], e.sampler.temperature, e.sampler.top_k,
                                  e.sampler.top_p))  # [k+1, V]
        draws = e.sampler.draws(k, rows.shape[-1])
        uniform.append(draws[0])
        noise.append(draws[1])
        row += k + 1
    q = None
    if any(e.draft_probs is not None for e in entries):  # point-mass drafts as one-hot rows beside them
        vocab = rows.shape[-1]
        q = torch.cat([e.draft_probs.float() if e.draft_probs is not None
                       else torch.nn.functional.one_hot(torch.tensor(e.draft, dtype=torch.long, device=rows.device),
                                                        vocab).float()
                       for e in entries])  # [N, V]
    inputs = (torch.cat(probs), drafts, cu, torch.cat(uniform), torch.stack(noise))
    return kernels.rejection_sample(*inputs) if q is None else kernels.rejection_sample(*inputs, q)


def _read_back(indices, entries, parts, outcomes) -> None:
    """Each entry's outcome from the host copies of its kind's results."""
    num_accepted, output = parts[0], parts[1]
    invalid = parts[2] if len(parts) > 2 else None
    row = 0
    for j, (i, e) in enumerate(zip(indices, entries)):
        accepted = num_accepted[j]
        if invalid is not None and invalid[j] >= 0:
            outcomes[i] = InvalidDistributionError(
                f"the model's distribution at draft position {invalid[j]} is not a distribution "
                "(NaN, infinite, negative or without mass); nothing was sampled from it")
        else:
            outcomes[i] = (accepted, output[row:row + accepted + 1])
        row += len(e.draft) + 1
