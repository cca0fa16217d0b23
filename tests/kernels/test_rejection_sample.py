"""Tests for foretell.kernels.rejection_sample (flat layout): the Triton kernels (run by Triton's
interpreter on CPU tensors, compiled with FORETELL_TEST_DEVICE=cuda) against the torch
reference, and the reference against plain loops written from the rule itself."""

import os

# Before triton is imported (see test_greedy_verify.py).
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("FORETELL_TEST_DEVICE") == "cuda" else "1")

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from foretell.kernels.launches import LAUNCHES  # noqa: E402

rs = importlib.import_module("foretell.kernels.rejection_sample")
reference, triton_fn = rs.rejection_sample_reference, rs.rejection_sample_triton

from tests.kernels.flat import DEVICE, dev, split, spans  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter_active():
    if DEVICE.type == "cpu" and not rs._kernels_interpreted():
        pytest.fail("Triton's interpreter is not active: TRITON_INTERPRET=1 must be set before "
                    "triton is first imported")


def kernel(**kw):
    return lambda *a: triton_fn(*a, **kw)


def loop_oracle(probs, draft, cu, uniform, exp_noise):
    """The rule, one token at a time, in Python scalars (fp32 division as torch does it)."""
    probs, draft, cu, uniform, exp_noise = (t.cpu() for t in (probs, draft, cu, uniform, exp_noise))
    V = probs.shape[1]
    accepted_all, outputs, invalid_all = [], [], []
    for b, (ds, k, r0) in enumerate(spans(cu)):
        out, invalid = [], -1
        stop, excluded = k, -1
        for j in range(k):
            row = probs[r0 + j]
            if not (torch.isfinite(row).all() and (row >= 0).all() and row.sum() > 0):
                stop, invalid = j, j
                break
            x = int(draft[ds + j])
            p_x = float(row[x]) if 0 <= x < V else 0.0
            if float(uniform[ds + j]) < p_x:
                out.append(x)
                continue
            stop, excluded = j, x
            break
        row = probs[r0 + stop]
        if invalid < 0 and not (torch.isfinite(row).all() and (row >= 0).all() and row.sum() > 0):
            invalid = stop
        token = -1
        if invalid < 0:
            best = -1.0
            for i in range(V):
                w = row[i]
                if i != excluded and float(w) > 0:
                    score = float(w / exp_noise[b, i])
                    if score > best:
                        best, token = score, i
            if best < 0:
                invalid, token = stop, -1
        accepted_all.append(len(out))
        outputs += out + [token] + [-1] * (k - len(out))
        invalid_all.append(invalid)
    as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return as_long(accepted_all), as_long(outputs), as_long(invalid_all)


def per_sequence_oracle(fn, probs, draft, cu, uniform, exp_noise):
    """The engine's former loop: ``fn`` once per sequence with B = 1, results concatenated."""
    parts = []
    for b, (ds, k, r0) in enumerate(spans(cu)):
        res = fn(probs[r0:r0 + k + 1], draft[ds:ds + k], dev(torch.tensor([k])), uniform[ds:ds + k],
                 exp_noise[b:b + 1])
        assert [tuple(t.shape) for t in res] == [(1,), (k + 1,), (1,)]
        parts.append(res)
    empty = dev(torch.empty(0, dtype=torch.int64))
    return tuple(torch.cat([p[i] for p in parts] or [empty]) for i in range(3))


def random_ks(B, K, seed):
    return torch.randint(0, K + 1, (B,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_case(ks, V, seed, sharpness=3.0, draft_from="likely"):
    """Random distributions, drafts that are often (not always) accepted, random draws."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.as_tensor(list(ks), dtype=torch.int64)
    B, N = ks.shape[0], int(ks.sum())
    probs = torch.softmax(torch.randn(N + B, V, generator=g) * sharpness, dim=-1)
    if draft_from == "likely":
        draft_row = torch.arange(N) + torch.repeat_interleave(torch.arange(B), ks)
        draft = probs[draft_row].argmax(dim=-1)
        flip = torch.rand(N, generator=g) < 0.3
        draft = torch.where(flip, torch.randint(0, V, (N,), generator=g), draft)
    else:
        draft = torch.randint(0, V, (N,), generator=g)
    uniform = torch.rand(N, generator=g)
    exp_noise = torch.empty(B, V).exponential_(generator=g)
    return dev(probs, draft, ks.cumsum(0), uniform, exp_noise)


def assert_same(a, b):
    for name, x, y in zip(("num_accepted", "output_tokens", "invalid_row"), a, b):
        assert x.dtype == torch.int64, f"{name} is {x.dtype}"
        assert torch.equal(x.cpu(), y.cpu()), f"{name} differs:\n{x}\n{y}"


@pytest.mark.parametrize("B,K,V,block_v,block_k", [
    (1, 0, 7, 4, 2), (1, 1, 33, 16, 1), (3, 5, 37, 16, 4), (4, 8, 64, 64, 8),
    (2, 17, 100, 32, 8), (5, 3, 1000, 256, 2),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference_and_oracle(B, K, V, block_v, block_k, seed):
    ks = random_ks(B, K, seed)
    ks[0] = K  # the longest draft always occurs
    case = make_case(ks, V, seed)
    expected = reference(*case)
    assert_same(triton_fn(*case, block_v=block_v, block_k=block_k), expected)
    assert_same(loop_oracle(*case), expected)


@pytest.mark.parametrize("seed", [20, 21, 22])
def test_flat_ragged_matches_per_sequence_loop(seed):
    ks = random_ks(7, 6, seed)
    ks[seed % 7] = 0  # some sequences have no draft
    case = make_case(ks, 40, seed, sharpness=4.0)
    expected = reference(*case)
    assert_same(triton_fn(*case, block_v=16, block_k=4), expected)
    assert_same(per_sequence_oracle(reference, *case), expected)
    assert_same(per_sequence_oracle(kernel(block_v=16, block_k=4), *case), expected)
    assert_same(loop_oracle(*case), expected)
    # Sequence b's output lives at its own rows: draft[:n], a sampled token, then -1.
    draft, cu = case[1], case[2]
    for (ds, k, _), n, row in zip(spans(cu), expected[0].tolist(), split(expected[1], cu)):
        assert row[:n] == draft[ds:ds + n].tolist() and 0 <= row[n] < 40 and row[n + 1:] == [-1] * (k - n)


def test_unlikely_drafts_are_mostly_rejected_and_still_match():
    case = make_case([6, 2, 0, 6, 5, 1], 50, seed=5, draft_from="random")
    expected = reference(*case)
    assert_same(triton_fn(*case, block_v=16, block_k=4), expected)
    assert_same(loop_oracle(*case), expected)
    assert (expected[0] < cu_lengths(case[2])).sum() >= 4


def cu_lengths(cu):
    return dev(torch.tensor([k for _, k, _ in spans(cu)]))


def test_no_drafts_at_all():
    # Every k = 0 (N = 0): one bonus token per sequence from its only row.
    case = make_case([0, 0, 0], 30, seed=6)
    assert case[1].shape == (0,) and case[3].shape == (0,)
    expected = reference(*case)
    assert_same(triton_fn(*case, block_v=8, block_k=2), expected)
    assert_same(loop_oracle(*case), expected)
    assert expected[0].tolist() == [0, 0, 0] and expected[2].tolist() == [-1, -1, -1]


def test_certain_and_impossible_drafts():
    V = 8
    probs = torch.zeros(6, V)
    probs[:, 3] = 1.0  # every row is a point mass on token 3
    draft = torch.tensor([3, 3, 3, 5])
    cu = torch.tensor([2, 4])
    uniform = torch.full((4,), 0.999999)  # p = 1 is accepted even at the top of [0, 1)
    exp_noise = torch.ones(2, V)
    case = dev(probs, draft, cu, uniform, exp_noise)
    for fn in (reference, kernel(block_v=4, block_k=2)):
        accepted, out, invalid = fn(*case)
        assert accepted.tolist() == [2, 1]
        # Sequence 0: bonus from the point mass. Sequence 1: token 5 has p = 0 and is rejected;
        # the residual (p without token 5) is still the point mass on token 3.
        assert out.tolist() == [3, 3, 3] + [3, 3, -1]
        assert invalid.tolist() == [-1, -1]


def test_rejected_token_is_never_the_recovered_one():
    # Two tokens; the draft takes the likelier one and is rejected: the residual has one token.
    probs = torch.tensor([[0.0, 0.9, 0.1, 0.0]]).expand(2, 4).contiguous()
    draft, cu = torch.tensor([1]), torch.tensor([1])
    uniform = torch.tensor([0.95])  # >= 0.9: rejected
    for seed in range(20):
        exp_noise = torch.empty(1, 4).exponential_(generator=torch.Generator().manual_seed(seed))
        case = dev(probs, draft, cu, uniform, exp_noise)
        for fn in (reference, kernel(block_v=2, block_k=1)):
            accepted, out, invalid = fn(*case)
            assert accepted.item() == 0 and out.tolist() == [2, -1] and invalid.item() == -1


@pytest.mark.parametrize("poison", ["nan", "inf", "negative", "zeros"])
def test_bad_rows_fail_safe_and_are_reported(poison):
    ks, V = [4, 4, 4, 1], 20
    probs, _, cu, uniform, exp_noise = make_case(ks, V, seed=3)
    spans_ = spans(cu)
    draft = dev(torch.zeros(sum(ks), dtype=torch.long))
    for _, k, r0 in spans_[:3]:
        probs[r0:r0 + k] = 0.0
        probs[r0:r0 + k, 0] = 1.0  # drafts of token 0 are always accepted ...
    bad = {"nan": float("nan"), "inf": float("inf"), "negative": -0.5}.get(poison)
    for b, j in ((0, 2), (1, 4), (2, 0)):  # ... until the poisoned row (4 = the bonus row)
        r = spans_[b][2] + j
        if poison == "zeros":
            probs[r] = 0.0
        else:
            probs[r, 5] = bad
    case = (probs, draft, cu, uniform, exp_noise)
    for fn in (reference, kernel(block_v=8, block_k=2)):
        accepted, out, invalid = fn(*case)
        assert accepted.tolist()[:3] == [2, 4, 0]
        assert invalid.tolist()[:3] == [2, 4, 0]
        rows = split(out, cu)
        assert rows[0] == [0, 0, -1, -1, -1]  # nothing emitted from the bad row
        assert rows[1] == [0, 0, 0, 0, -1]
        assert rows[2] == [-1] * 5
        assert invalid[3] == -1 and rows[3][accepted[3]] >= 0  # the healthy neighbour is untouched
    assert_same(loop_oracle(*case), reference(*case))
    assert_same(per_sequence_oracle(reference, *case), reference(*case))


def test_rows_after_the_stop_are_never_used():
    # (Formerly: padding rows are never read.) Once a sequence stops at row n, its later rows
    # cannot change the result, even when they are not distributions.
    probs, draft, cu, uniform, exp_noise = make_case([0, 2, 6], 30, seed=9)
    uniform = torch.zeros_like(uniform)
    uniform[2 + 3] = 1.0  # sequence 2 rejects its 4th draft; sequences 0 and 1 accept all
    expected = reference(probs, draft, cu, uniform, exp_noise)
    accepted = expected[0].tolist()
    assert accepted[2] == 3
    probs = probs.clone()
    r0 = spans(cu)[2][2]
    probs[r0 + 4:r0 + 7] = float("nan")
    for fn in (reference, kernel(block_v=8, block_k=4)):
        assert_same(fn(probs, draft, cu, uniform, exp_noise), expected)


def test_draft_tokens_outside_the_vocabulary_are_rejected():
    probs, _, cu, uniform, exp_noise = make_case([3, 3], 16, seed=4)
    draft = dev(torch.tensor([99, 1, 1, -5, 2, 2]))
    for fn in (reference, kernel(block_v=8, block_k=2)):
        accepted, out, invalid = fn(probs, draft, cu, uniform, exp_noise)
        assert accepted.tolist() == [0, 0] and invalid.tolist() == [-1, -1]
        assert all(0 <= row[0] < 16 for row in split(out, cu))


def test_kernel_clamps_out_of_range_cu():
    # The launcher does not check cu's values (that would sync the GPU); the kernel clamps each
    # sequence's span into [0, N]. cu = [-4, 9] with N = 3 clamps to the real [0, 3].
    probs, draft, cu, uniform, exp_noise = make_case([0, 3], 20, seed=12)
    expected = reference(probs, draft, cu, uniform, exp_noise)
    bad_cu = dev(torch.tensor([-4, 9]))
    assert_same(triton_fn(probs, draft, bad_cu, uniform, exp_noise, block_v=8, block_k=2), expected)
    with pytest.raises(ValueError, match="non-negative"):
        reference(probs, draft, bad_cu, uniform, exp_noise)


def test_empty_batch_and_int32_inputs_and_strided_probs():
    probs, draft, cu, uniform, exp_noise = make_case([3, 0, 4], 40, seed=11)
    expected = reference(probs, draft, cu, uniform, exp_noise)
    wide = dev(torch.zeros(probs.shape[0], 80))
    wide[:, ::2] = probs  # non-unit stride along V
    strided = wide[:, ::2]
    assert_same(triton_fn(strided, draft.int(), cu.int(), uniform, exp_noise, block_v=16), expected)
    assert_same(reference(strided, draft.int(), cu.int(), uniform, exp_noise), expected)
    empty = dev(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                torch.zeros(0), torch.zeros(0, 5))
    for fn in (reference, triton_fn, rs.rejection_sample):
        accepted, out, invalid = fn(*empty)
        assert accepted.shape == (0,) and out.shape == (0,) and invalid.shape == (0,)


def test_launch_counter_counts_one_per_call():
    case = make_case([2, 0, 3], 20, seed=13)
    before = LAUNCHES["rejection_sample"]
    triton_fn(*case, block_v=8)
    assert LAUNCHES["rejection_sample"] == before + 1  # two kernels, one count
    triton_fn(*case, block_v=8)
    reference(*case)  # the reference launches nothing
    assert LAUNCHES["rejection_sample"] == before + 2
    with pytest.raises(ValueError):  # a call that fails its checks launches nothing
        triton_fn(case[0][:-1], *case[1:])
    empty = dev(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                torch.zeros(0), torch.zeros(0, 5))
    triton_fn(*empty)  # nor does a call without sequences
    assert LAUNCHES["rejection_sample"] == before + 2


@pytest.mark.parametrize("mutate,match", [
    (lambda c: (c[0].double(),) + c[1:], "target_probs must be float32"),
    (lambda c: (c[0][0],) + c[1:], r"target_probs must be \[N \+ B, V\]"),
    (lambda c: (c[0][:, :0],) + c[1:], r"V >= 1"),
    (lambda c: (c[0], c[1].unsqueeze(0)) + c[2:], "draft_tokens must be 1-D"),
    (lambda c: c[:2] + (c[2].unsqueeze(0),) + c[3:], "cu_num_draft_tokens must be 1-D"),
    (lambda c: (c[0], c[1].float()) + c[2:], "draft_tokens must be int64 or int32"),
    (lambda c: c[:2] + (c[2].float(),) + c[3:], "cu_num_draft_tokens must be int64 or int32"),
    (lambda c: (c[0][:-1],) + c[1:], r"target_probs must have N \+ B = 3 \+ 2 = 5 rows"),
    (lambda c: (c[0], c[1][:2], c[2], c[3][:2], c[4]), r"N \+ B = 2 \+ 2 = 4 rows"),
    (lambda c: c[:3] + (c[3][:1], c[4]), "uniform must have shape"),
    (lambda c: c[:4] + (c[4][:, :3],), "exp_noise must have shape"),
    (lambda c: c[:4] + (c[4][:1],), "exp_noise must have shape"),
    (lambda c: c[:4] + (c[4].half(),), "exp_noise must be float32"),
    (lambda c: c[:3] + (c[3].to("meta"), c[4]), "same device"),
    (lambda c: (c[0][:3], c[1], c[2][:0], c[3], c[4][:0]), "draft_tokens must be empty"),
    (lambda c: (c[0], c[1], [1, 2]) + c[3:], "cu_num_draft_tokens must be a torch.Tensor"),
])
@pytest.mark.parametrize("fn", [reference, triton_fn])
def test_shape_and_dtype_checks(mutate, match, fn):
    case = make_case([1, 2], 10, seed=0)  # N = 3, B = 2: 5 rows
    with pytest.raises(ValueError, match=match):
        fn(*mutate(case))


@pytest.mark.parametrize("cu,match", [
    ([-1, 3], "non-negative"),
    ([3, 2], "non-decreasing"),
    ([1, 2], r"end at N = draft_tokens.shape\[0\] = 3"),
])
def test_reference_checks_cu_values(cu, match):
    probs, draft, _, uniform, exp_noise = make_case([1, 2], 10, seed=0)
    with pytest.raises(ValueError, match=match):
        reference(probs, draft, dev(torch.tensor(cu)), uniform, exp_noise)


def test_triton_specific_checks():
    case = make_case([1, 2], 10, seed=0)
    with pytest.raises(ValueError, match="block_v must be a positive power of two"):
        triton_fn(*case, block_v=12)
    with pytest.raises(ValueError, match="block_k must be a positive power of two"):
        triton_fn(*case, block_k=0)
    with pytest.raises(ValueError, match="CUDA"):
        triton_fn(*(t.to("meta") for t in case))


def test_dispatch_matches_the_reference():
    # The reference on CPU; the kernel on CUDA. Same answer either way.
    case = make_case([2, 0, 3], 10, seed=1)
    assert_same(rs.rejection_sample(*case), reference(*case))


def test_acceptance_rate_is_p_of_the_draft():
    """Over many draws a draft token with p = 0.3 is accepted about 30% of the time."""
    B, V = 4000, 5
    probs = dev(torch.tensor([0.3, 0.4, 0.1, 0.1, 0.1]).expand(2 * B, V).contiguous())
    draft, cu = dev(torch.zeros(B, dtype=torch.long), torch.arange(1, B + 1))  # one draft each
    g = torch.Generator().manual_seed(0)
    uniform, exp_noise = dev(torch.rand(B, generator=g), torch.empty(B, V).exponential_(generator=g))
    accepted, out, _ = reference(probs, draft, cu, uniform, exp_noise)
    rate = accepted.float().mean().item()
    assert abs(rate - 0.3) < 0.03  # 4 standard errors
    # Rejected sequences draw from the residual: tokens 1..4 in proportion 4:1:1:1, never token 0.
    recovered = out.view(B, 2)[accepted == 0, 0]
    assert (recovered != 0).all()
    share = (recovered == 1).float().mean().item()
    assert abs(share - 4 / 7) < 0.04


# ---- drafts drawn from a distribution q (a draft model) -------------------------------------------

def draft_distributions(draft, V, seed, sharpness=2.0):
    """q rows for ``draft`` [N]: random distributions, each giving its draft token some mass."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(draft.shape[0], V, generator=g) * sharpness, dim=-1)
    q[torch.arange(draft.shape[0]), draft.cpu()] += 0.05
    return dev(q / q.sum(dim=1, keepdim=True))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_v,block_k", [(16, 2), (64, 8)])
def test_kernel_with_a_draft_distribution_matches_the_reference(seed, block_v, block_k):
    probs, draft, cu, uniform, exp_noise = make_case(random_ks(6, 5, seed), 37, seed=seed)
    q = draft_distributions(draft, 37, seed)
    expected = reference(probs, draft, cu, uniform, exp_noise, q)
    assert_same(triton_fn(probs, draft, cu, uniform, exp_noise, q, block_v=block_v, block_k=block_k), expected)
    assert_same(rs.rejection_sample(probs, draft, cu, uniform, exp_noise, q), expected)


def test_a_one_hot_draft_distribution_is_the_point_mass_path():
    probs, draft, cu, uniform, exp_noise = make_case([3, 0, 4, 1], 29, seed=4)
    one_hot = torch.nn.functional.one_hot(draft, 29).float()
    expected = reference(probs, draft, cu, uniform, exp_noise)
    assert_same(reference(probs, draft, cu, uniform, exp_noise, one_hot), expected)
    assert_same(triton_fn(probs, draft, cu, uniform, exp_noise, one_hot, block_v=8, block_k=2), expected)


@pytest.mark.parametrize("poison", ["nan", "no mass on the draft"])
def test_a_bad_draft_distribution_fails_safe_and_is_reported(poison):
    probs, draft, cu, uniform, exp_noise = make_case([3], 20, seed=5)
    uniform = dev(torch.zeros(3))  # every draft would be accepted
    q = draft_distributions(draft, 20, 5)
    if poison == "nan":
        q[1, 0] = float("nan")
    else:
        q[1] = 0.0
        q[1, (int(draft[1]) + 1) % 20] = 1.0
    for fn in (reference, kernel(block_v=8, block_k=2)):
        accepted, out, invalid = fn(probs, draft, cu, uniform, exp_noise, q)
        assert (int(accepted[0]), int(invalid[0])) == (1, 1)
        assert out.tolist() == [int(draft[0]), -1, -1, -1]


def emitted_first_tokens(rule, p0, q0, p1, trials, seed):
    """The first token of ``trials`` sequences that each draft one token x ~ q0 (row 0: p0, the
    bonus row: p1), under ``rule``: the kernel's reference or a wrong rule."""
    V = p0.shape[0]
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q0, trials, replacement=True, generator=g)  # [trials]
    uniform = torch.rand(trials, generator=g)
    exp_noise = torch.empty(trials, V).exponential_(generator=g)
    if rule == "p/q rule":
        probs = torch.stack([p0, p1]).repeat(trials, 1)  # [2 trials, V]
        _, out, _ = reference(probs, draft, torch.arange(1, trials + 1), uniform, exp_noise,
                              q0.expand(trials, V).contiguous())
        return out.view(trials, 2)[:, 0]
    p_x, q_x = p0[draft], q0[draft]  # [trials]
    accept = (uniform < p_x) if rule == "accept by p alone" else (uniform * q_x < p_x)
    if rule == "recover without x":  # the point-mass residual after a test by p/q
        weights = p0.expand(trials, V).clone()
        weights[torch.arange(trials), draft] = 0.0
    elif rule == "recover from p":  # the residual p - q not taken
        weights = p0.expand(trials, V)
    else:  # accept by p alone, recover from max(0, p - q)
        weights = (p0 - q0).clamp(min=0).expand(trials, V)
    recovered = torch.where(weights > 0, weights / exp_noise, torch.full_like(exp_noise, -1.0)).argmax(dim=1)
    return torch.where(accept, draft, recovered)


@pytest.mark.parametrize("rule,exact", [("p/q rule", True), ("recover without x", False),
                                        ("recover from p", False), ("accept by p alone", False)])
def test_drafts_from_q_keep_the_target_distribution(rule, exact):
    """The first token of a sequence that drafted x ~ q follows p exactly (chi-square at alpha =
    0.001), and the wrong rules are caught by the same test."""
    from collections import Counter

    from tests.helpers import chi_square

    p0 = torch.tensor([0.35, 0.05, 0.3, 0.1, 0.2])
    q0 = torch.tensor([0.1, 0.5, 0.1, 0.2, 0.1])  # a draft model that likes token 1, which p does not
    p1 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    trials = 20000
    first = emitted_first_tokens(rule, p0, q0, p1, trials, seed=0)
    counts = Counter((int(token),) for token in first)
    stat, critical = chi_square(counts, {(v,): float(p0[v]) for v in range(5)}, trials)
    assert (stat < critical) == exact, (stat, critical, sorted(counts.items()))
