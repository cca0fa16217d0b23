"""Tests for foretell.kernels.rejection_sample: the Triton kernels (run by Triton's interpreter on
CPU tensors) against the torch reference, and the reference against a plain loop written from
the rule itself."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_greedy_verify.py)

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

rs = importlib.import_module("foretell.kernels.rejection_sample")
reference, triton_fn = rs.rejection_sample_reference, rs.rejection_sample_triton


@pytest.fixture(autouse=True)
def interpreter_active():
    if not rs._kernels_interpreted():
        pytest.fail("Triton's interpreter is not active: TRITON_INTERPRET=1 must be set before "
                    "triton is first imported")


def loop_oracle(probs, draft, num_draft, uniform, exp_noise):
    """The rule, one token at a time, in Python scalars (fp32 division as torch does it)."""
    B, K1, V = probs.shape
    accepted_all, outputs, invalid_all = [], [], []
    for b in range(B):
        out, invalid = [], -1
        n = int(num_draft[b])
        stop, excluded = n, -1
        for j in range(n):
            row = probs[b, j]
            if not (torch.isfinite(row).all() and (row >= 0).all() and row.sum() > 0):
                stop, invalid = j, j
                break
            x = int(draft[b, j])
            p_x = float(row[x]) if 0 <= x < V else 0.0
            if float(uniform[b, j]) < p_x:
                out.append(x)
                continue
            stop, excluded = j, x
            break
        if invalid < 0:
            row = probs[b, stop]
            if not (torch.isfinite(row).all() and (row >= 0).all() and row.sum() > 0):
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
        outputs.append(out + [token] + [-1] * (K1 - 1 - len(out)))
        invalid_all.append(invalid)
    return torch.tensor(accepted_all), torch.tensor(outputs).view(B, K1), torch.tensor(invalid_all)


def make_case(B, K, V, seed, sharpness=3.0, draft_from="likely"):
    """Random distributions, drafts that are often (not always) accepted, random draws."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(B, K + 1, V, generator=g) * sharpness, dim=-1)
    if draft_from == "likely":
        draft = probs[:, :K].argmax(dim=-1)
        flip = torch.rand(B, K, generator=g) < 0.3
        draft = torch.where(flip, torch.randint(0, V, (B, K), generator=g), draft)
    else:
        draft = torch.randint(0, V, (B, K), generator=g)
    num_draft = torch.randint(0, K + 1, (B,), generator=g)
    draft = torch.where(torch.arange(K) < num_draft.unsqueeze(1), draft, torch.full_like(draft, -1))
    uniform = torch.rand(B, K, generator=g)
    exp_noise = torch.empty(B, V).exponential_(generator=g)
    return probs, draft, num_draft, uniform, exp_noise


def assert_same(a, b):
    for name, x, y in zip(("num_accepted", "output_tokens", "invalid_row"), a, b):
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


@pytest.mark.parametrize("B,K,V,block_v,block_k", [
    (1, 0, 7, 4, 2), (1, 1, 33, 16, 1), (3, 5, 37, 16, 4), (4, 8, 64, 64, 8),
    (2, 17, 100, 32, 8), (5, 3, 1000, 256, 2),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference_and_oracle(B, K, V, block_v, block_k, seed):
    case = make_case(B, K, V, seed)
    expected = reference(*case)
    assert_same(triton_fn(*case, block_v=block_v, block_k=block_k), expected)
    assert_same(loop_oracle(*case), expected)


def test_unlikely_drafts_are_mostly_rejected_and_still_match():
    case = make_case(6, 6, 50, seed=5, draft_from="random")
    expected = reference(*case)
    assert_same(triton_fn(*case, block_v=16, block_k=4), expected)
    assert_same(loop_oracle(*case), expected)


def test_certain_and_impossible_drafts():
    V = 8
    probs = torch.zeros(2, 3, V)
    probs[:, :, 3] = 1.0  # every row is a point mass on token 3
    draft = torch.tensor([[3, 3], [3, 5]])
    num_draft = torch.tensor([2, 2])
    uniform = torch.full((2, 2), 0.999999)  # p = 1 is accepted even at the top of [0, 1)
    exp_noise = torch.ones(2, V)
    for fn in (reference, lambda *a: triton_fn(*a, block_v=4, block_k=2)):
        accepted, out, invalid = fn(probs, draft, num_draft, uniform, exp_noise)
        assert accepted.tolist() == [2, 1]
        assert out[0].tolist() == [3, 3, 3]  # bonus from the point mass
        # Request 1: token 5 has p = 0 and is rejected; the residual (p without token 5) is
        # still the point mass on token 3.
        assert out[1].tolist() == [3, 3, -1]
        assert invalid.tolist() == [-1, -1]


def test_rejected_token_is_never_the_recovered_one():
    # Two tokens; the draft takes the likelier one and is rejected: the residual has one token.
    probs = torch.tensor([[[0.0, 0.9, 0.1, 0.0]]]).expand(1, 2, 4).contiguous()
    draft, num_draft = torch.tensor([[1]]), torch.tensor([1])
    uniform = torch.tensor([[0.95]])  # >= 0.9: rejected
    for seed in range(20):
        exp_noise = torch.empty(1, 4).exponential_(generator=torch.Generator().manual_seed(seed))
        for fn in (reference, lambda *a: triton_fn(*a, block_v=2, block_k=1)):
            accepted, out, invalid = fn(probs, draft, num_draft, uniform, exp_noise)
            assert accepted.item() == 0 and out[0].tolist() == [2, -1] and invalid.item() == -1


@pytest.mark.parametrize("poison", ["nan", "inf", "negative", "zeros"])
def test_bad_rows_fail_safe_and_are_reported(poison):
    B, K, V = 3, 4, 20
    probs, draft, num_draft, uniform, exp_noise = make_case(B, K, V, seed=3)
    probs[:, :K] = 0.0
    probs[:, :K, 0] = 1.0  # drafts of token 0 are always accepted ...
    draft = torch.zeros(B, K, dtype=torch.long)
    num_draft = torch.tensor([4, 4, 4])
    bad = {"nan": float("nan"), "inf": float("inf"), "negative": -0.5}.get(poison)
    for b, row in ((0, 2), (1, 4), (2, 0)):  # ... until the poisoned row (4 = the bonus row)
        if poison == "zeros":
            probs[b, row] = 0.0
        else:
            probs[b, row, 5] = bad
    for fn in (reference, lambda *a: triton_fn(*a, block_v=8, block_k=2)):
        accepted, out, invalid = fn(probs, draft, num_draft, uniform, exp_noise)
        assert accepted.tolist() == [2, 4, 0]
        assert invalid.tolist() == [2, 4, 0]
        assert out[0].tolist() == [0, 0, -1, -1, -1]  # nothing emitted from the bad row
        assert out[1].tolist() == [0, 0, 0, 0, -1]
        assert out[2].tolist() == [-1] * 5
    assert_same(loop_oracle(probs, draft, num_draft, uniform, exp_noise),
                reference(probs, draft, num_draft, uniform, exp_noise))


def test_garbage_in_padding_rows_is_never_read():
    probs, draft, num_draft, uniform, exp_noise = make_case(3, 6, 30, seed=9)
    num_draft = torch.tensor([0, 2, 6])
    draft[0], draft[1, 2:] = -1, -1
    expected = reference(probs, draft, num_draft, uniform, exp_noise)
    probs[0, 1:] = float("nan")
    probs[1, 3:] = -7.0
    assert_same(reference(probs, draft, num_draft, uniform, exp_noise), expected)
    assert_same(triton_fn(probs, draft, num_draft, uniform, exp_noise, block_v=8, block_k=4), expected)


def test_draft_tokens_outside_the_vocabulary_are_rejected():
    probs, draft, num_draft, uniform, exp_noise = make_case(2, 3, 16, seed=4)
    draft = torch.tensor([[99, 1, 1], [-5, 2, 2]])
    num_draft = torch.tensor([3, 3])
    for fn in (reference, lambda *a: triton_fn(*a, block_v=8, block_k=2)):
        accepted, out, invalid = fn(probs, draft, num_draft, uniform, exp_noise)
        assert accepted.tolist() == [0, 0] and invalid.tolist() == [-1, -1]
        assert all(0 <= t < 16 for t in out[:, 0].tolist())


def test_empty_batch_and_int32_inputs_and_strided_probs():
    probs, draft, num_draft, uniform, exp_noise = make_case(3, 4, 40, seed=11)
    expected = reference(probs, draft, num_draft, uniform, exp_noise)
    wide = torch.zeros(3, 5, 80)
    wide[:, :, ::2] = probs  # non-unit stride along V
    strided = wide[:, :, ::2]
    assert_same(triton_fn(strided, draft.int(), num_draft.int(), uniform, exp_noise, block_v=16), expected)
    assert_same(reference(strided, draft.int(), num_draft.int(), uniform, exp_noise), expected)
    empty = (torch.zeros(0, 3, 5), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long),
             torch.zeros(0, 2), torch.zeros(0, 5))
    for fn in (reference, triton_fn):
        accepted, out, invalid = fn(*empty)
        assert accepted.shape == (0,) and out.shape == (0, 3) and invalid.shape == (0,)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: (c[0].double(),) + c[1:], "target_probs must be float32"),
    (lambda c: (c[0][0],) + c[1:], r"target_probs must be \[B, K\+1, V\]"),
    (lambda c: (c[0], c[1][:, :-1]) + c[2:], "draft_tokens must have shape"),
    (lambda c: (c[0], c[1].float()) + c[2:], "draft_tokens must be int64 or int32"),
    (lambda c: c[:3] + (c[3][:, :1], c[4]), "uniform must have shape"),
    (lambda c: c[:4] + (c[4][:, :3],), "exp_noise must have shape"),
    (lambda c: c[:4] + (c[4].half(),), "exp_noise must be float32"),
    (lambda c: (c[0], c[1], [1, 2]) + c[3:], "num_draft must be a torch.Tensor"),
])
@pytest.mark.parametrize("fn", [reference, triton_fn])
def test_shape_and_dtype_checks(mutate, match, fn):
    case = make_case(2, 3, 10, seed=0)
    with pytest.raises(ValueError, match=match):
        fn(*mutate(case))


def test_reference_rejects_out_of_range_num_draft():
    probs, draft, _, uniform, exp_noise = make_case(2, 3, 10, seed=0)
    with pytest.raises(ValueError, match=r"num_draft values must lie in \[0, K\]"):
        reference(probs, draft, torch.tensor([1, 4]), uniform, exp_noise)


def test_dispatch_uses_the_reference_on_cpu():
    case = make_case(2, 3, 10, seed=1)
    assert_same(rs.rejection_sample(*case), reference(*case))


def test_acceptance_rate_is_p_of_the_draft():
    """Over many draws a draft token with p = 0.3 is accepted about 30% of the time."""
    N, V = 4000, 5
    probs = torch.tensor([0.3, 0.4, 0.1, 0.1, 0.1]).expand(N, 2, V).contiguous()
    draft, num_draft = torch.zeros(N, 1, dtype=torch.long), torch.ones(N, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    accepted, out, _ = reference(probs, draft, num_draft, torch.rand(N, 1, generator=g),
                                 torch.empty(N, V).exponential_(generator=g))
    rate = accepted.float().mean().item()
    assert abs(rate - 0.3) < 0.03  # 4 standard errors
    # Rejected rows draw from the residual: tokens 1..4 in proportion 4:1:1:1, never token 0.
    recovered = out[accepted == 0, 0]
    assert (recovered != 0).all()
    share = (recovered == 1).float().mean().item()
    assert abs(share - 4 / 7) < 0.04
