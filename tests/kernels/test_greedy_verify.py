"""Tests for foretell.kernels.greedy_verify (flat layout).

On CPU the Triton kernels run through Triton's interpreter, so the environment
variable must be set before triton / foretell.kernels are imported: ``triton.jit``
decides at decoration time (i.e. when triton.language and the kernel module are
imported) whether it builds an interpreted or a compiled function. With
``FORETELL_TEST_DEVICE=cuda`` every tensor is built on the GPU and the compiled
kernels run instead.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("FORETELL_TEST_DEVICE") == "cuda" else "1")

import builtins  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import foretell.kernels  # noqa: E402
from foretell.kernels.launches import LAUNCHES  # noqa: E402

# `foretell.kernels.greedy_verify` as an attribute is the *function* re-exported by
# the package __init__, so the module has to be taken from sys.modules.
gv = importlib.import_module("foretell.kernels.greedy_verify")

from tests.kernels.flat import DEVICE, cu_of, dev, split, spans  # noqa: E402


@pytest.fixture
def interpreter_active():
    # On CPU the kernels need Triton's interpreter. TRITON_INTERPRET is read when
    # `triton` itself is imported (triton.language's own helpers such as tl.max are
    # @jit functions too) and when our kernels are decorated. If anything imported
    # triton before this module set the variable, the kernels are compiled ones and
    # cannot run on CPU tensors; reloading our module does not help because
    # triton.language stays compiled. On CUDA the compiled kernels run: nothing to check.
    if DEVICE.type == "cpu" and not gv._kernels_interpreted():
        pytest.fail(
            "Triton's interpreter is not active: triton or foretell.kernels was imported before "
            "TRITON_INTERPRET=1 was set. Run this test module on its own or export TRITON_INTERPRET=1."
        )


def needs_triton(test):
    test = pytest.mark.usefixtures("interpreter_active")(test)
    return pytest.mark.skipif(not gv.HAVE_TRITON, reason="triton is not installed")(test)


greedy_verify = gv.greedy_verify
greedy_verify_reference = gv.greedy_verify_reference
greedy_verify_triton = gv.greedy_verify_triton


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def assert_same(got, want):
    """Exact equality of (num_accepted, output_tokens), dtypes and shapes included."""
    (na_g, out_g), (na_w, out_w) = got, want
    assert na_g.dtype == torch.int64 and out_g.dtype == torch.int64
    assert na_g.shape == na_w.shape and out_g.shape == out_w.shape
    assert torch.equal(na_g.cpu(), na_w.cpu()), f"num_accepted {na_g.tolist()} != {na_w.tolist()}"
    assert torch.equal(out_g.cpu(), out_w.cpu()), f"output_tokens\n{out_g}\n!=\n{out_w}"


def check_kernel(logits, draft, cu, **kw):
    """Kernel == reference, exactly. Returns the reference result."""
    want = greedy_verify_reference(logits, draft, cu)
    got = greedy_verify_triton(logits, draft, cu, **kw)
    assert_same(got, want)
    return want


def per_sequence_oracle(fn, logits, draft, cu):
    """The engine's former loop: ``fn`` once per sequence with B = 1, results concatenated."""
    num_accepted, outputs = [], []
    for ds, k, rs in spans(cu):
        na, out = fn(logits[rs:rs + k + 1], draft[ds:ds + k], dev(torch.tensor([k])))
        assert na.shape == (1,) and out.shape == (k + 1,)
        num_accepted.append(na)
        outputs.append(out)
    empty = dev(torch.empty(0, dtype=torch.int64))
    return torch.cat(num_accepted or [empty]), torch.cat(outputs or [empty])


def first_max_index(values):
    """First index of the maximum of a list of (non-NaN) floats, in plain Python."""
    best_i, best_v = 0, values[0]
    for i, v in enumerate(values):
        if v > best_v:
            best_i, best_v = i, v
    return best_i


def loop_oracle(logits, draft, cu):
    """Hand-written greedy verify: walk the positions, compare draft with argmax."""
    num_accepted, outputs = [], []
    for ds, k, rs in spans(cu):
        row = []
        for j in range(k + 1):
            t = first_max_index(logits[rs + j].tolist())
            row.append(t)
            if j == k or int(draft[ds + j]) != t:
                break
        num_accepted.append(len(row) - 1)
        outputs += row + [-1] * (k + 1 - len(row))
    return torch.tensor(num_accepted, dtype=torch.int64), torch.tensor(outputs, dtype=torch.int64)


def make_case(ks, V, *, seed, accept_prob=0.7, dtype=torch.float32):
    """Random flat logits [N + B, V] and drafts that follow the target's argmax with
    probability accept_prob per position (else a random token). Returns tensors on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.as_tensor(list(ks), dtype=torch.int64)
    B, N = ks.shape[0], int(ks.sum())
    logits = torch.randn(N + B, V, generator=g).to(dtype)
    target = logits.argmax(dim=-1)
    seq_of_draft = torch.repeat_interleave(torch.arange(B), ks)
    follow = torch.rand(N, generator=g) < accept_prob
    draft = torch.where(follow, target[torch.arange(N) + seq_of_draft], torch.randint(0, V, (N,), generator=g))
    return dev(logits, draft, ks.cumsum(0))


def random_ks(B, K, seed):
    """B draft counts in [0, K]."""
    return torch.randint(0, K + 1, (B,), generator=torch.Generator().manual_seed(seed)).tolist()


# --------------------------------------------------------------------------- #
# setup
# --------------------------------------------------------------------------- #


@needs_triton
def test_kernels_smoke():
    if DEVICE.type == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert type(gv._row_argmax_kernel).__name__ == "InterpretedFunction"
        assert type(gv._accept_kernel).__name__ == "InterpretedFunction"
    else:  # a CUDA run must test the compiled kernels, not the interpreter
        assert not gv._kernels_interpreted()
    # Two sequences: k = 1 (accepted, bonus 6) and k = 0 (bonus 2).
    logits = torch.zeros(3, 8)
    logits[0, 3] = logits[1, 6] = logits[2, 2] = 1.0
    na, out = greedy_verify_triton(*dev(logits, torch.tensor([3]), torch.tensor([1, 1])))
    assert na.device.type == DEVICE.type
    assert na.tolist() == [1, 0] and out.tolist() == [3, 6, 2]


def test_package_exports():
    assert foretell.kernels.greedy_verify_reference is greedy_verify_reference
    assert foretell.kernels.greedy_verify_triton is greedy_verify_triton
    assert foretell.kernels.greedy_verify is greedy_verify


@needs_triton
def test_launch_counter_counts_one_per_call():
    logits, draft, cu = make_case([2, 0, 3], 40, seed=30)
    before = LAUNCHES["greedy_verify"]
    greedy_verify_triton(logits, draft, cu, block_v=16)
    assert LAUNCHES["greedy_verify"] == before + 1  # two kernels, one count
    greedy_verify_triton(logits, draft, cu, block_v=16)
    assert LAUNCHES["greedy_verify"] == before + 2
    greedy_verify_reference(logits, draft, cu)  # the reference launches nothing
    assert LAUNCHES["greedy_verify"] == before + 2
    # A call that fails its checks, or has no sequence, launches nothing.
    with pytest.raises(ValueError):
        greedy_verify_triton(logits[:-1], draft, cu)
    greedy_verify_triton(*dev(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
    assert LAUNCHES["greedy_verify"] == before + 2


# --------------------------------------------------------------------------- #
# kernel == reference
# --------------------------------------------------------------------------- #


@needs_triton
@pytest.mark.parametrize(
    "ks,V,block_v,block_k",
    [
        ([5, 0, 3, 1], 50, 1024, 64),  # one block, mostly masked
        ([4, 4, 0], 129, 64, 2),  # V not a multiple of BLOCK_V; drafts span several k-blocks
        ([6, 2, 0, 5, 1], 300, 64, 4),  # five blocks, last one partial
        ([0, 3], 256, 64, 1),  # exact multiple of BLOCK_V; one draft per k-block
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_matches_reference(ks, V, block_v, block_k, seed):
    logits, draft, cu = make_case(ks, V, seed=seed)
    check_kernel(logits, draft, cu, block_v=block_v, block_k=block_k)


@needs_triton
@pytest.mark.parametrize("seed", [20, 21, 22])
def test_flat_ragged_matches_reference_and_per_sequence_loop(seed):
    # Ragged draft counts, zeros included (random_ks draws from [0, 6]; 0 forced in).
    ks = random_ks(7, 6, seed)
    ks[seed % 7] = 0
    logits, draft, cu = make_case(ks, 70, seed=seed, accept_prob=0.8)
    want = check_kernel(logits, draft, cu, block_v=32, block_k=4)
    assert_same(per_sequence_oracle(greedy_verify_reference, logits, draft, cu), want)
    assert_same(per_sequence_oracle(lambda *a: greedy_verify_triton(*a, block_v=32, block_k=4), logits, draft, cu), want)
    assert_same(loop_oracle(logits.cpu(), draft.cpu(), cu.cpu()), want)
    # Every sequence gains n + 1 tokens, at its own rows.
    for (ds, k, rs), n, row in zip(spans(cu), want[0].tolist(), split(want[1], cu)):
        assert 0 <= n <= k
        assert row[:n] == draft[ds:ds + n].tolist()
        assert row[n] == int(logits[rs + n].argmax()) and row[n + 1:] == [-1] * (k - n)


@needs_triton
@pytest.mark.parametrize("block_v", [32, 1024])
def test_all_accepted_bonus_token(block_v):
    ks = [4, 4, 2]
    logits, _, cu = make_case(ks, 200, seed=3)
    target = logits.argmax(dim=-1)
    # The drafts are exactly the target's choices: every row but each sequence's last.
    last_rows = cu + torch.arange(len(ks), device=DEVICE)  # row_start + k
    keep = torch.ones(target.shape[0], dtype=torch.bool, device=DEVICE)
    keep[last_rows] = False
    draft = target[keep]
    na, out = check_kernel(logits, draft, cu, block_v=block_v)
    assert na.tolist() == ks
    assert torch.equal(out, target)  # k accepted drafts + bonus target[k], everywhere


@needs_triton
def test_first_draft_rejected():
    ks = [4, 1, 2]
    logits, _, cu = make_case(ks, 120, seed=4)
    target = logits.argmax(dim=-1)
    draft = dev(torch.tensor([0, 0, 0, 0, 0, 0, 0]))
    for ds, k, rs in spans(cu):  # first draft wrong, the rest right
        draft[ds:ds + k] = target[rs:rs + k]
        draft[ds] = (target[rs] + 1) % 120
    na, out = check_kernel(logits, draft, cu, block_v=64)
    assert na.tolist() == [0, 0, 0]
    for (ds, k, rs), row in zip(spans(cu), split(out, cu)):
        assert row == [int(target[rs])] + [-1] * k  # recovered token, then -1


@needs_triton
def test_sequences_without_drafts():
    # Some sequences have no draft: their only row gives the bonus token.
    logits, draft, cu = make_case([0, 3, 0, 0], 90, seed=5)
    na, out = check_kernel(logits, draft, cu, block_v=64)
    rows = split(out, cu)
    for (ds, k, rs), n, row in zip(spans(cu), na.tolist(), rows):
        if k == 0:
            assert n == 0 and row == [int(logits[rs].argmax())]

    # No drafts at all (every k = 0, N = 0): draft_tokens is [0], the output the bonus tokens.
    logits = dev(torch.randn(4, 70, generator=torch.Generator().manual_seed(6)))
    draft = dev(torch.empty(0, dtype=torch.int64))
    cu = dev(torch.zeros(4, dtype=torch.int64))
    na, out = check_kernel(logits, draft, cu, block_v=32)
    assert na.tolist() == [0] * 4
    assert out.shape == (4,) and out.tolist() == logits.argmax(-1).tolist()


@needs_triton
def test_empty_batch():
    logits = dev(torch.randn(0, 10))
    draft = dev(torch.empty(0, dtype=torch.int64))
    cu = dev(torch.empty(0, dtype=torch.int64))
    na, out = greedy_verify_triton(logits, draft, cu)
    assert na.shape == (0,) and out.shape == (0,)
    assert_same((na, out), greedy_verify_reference(logits, draft, cu))
    assert_same(greedy_verify(logits, draft, cu), (na, out))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ties_take_first_index(dtype):
    V, BLOCK_V = 300, 64
    # Each row holds several equal maxima; the expected answer is the first.
    tie_sets = [
        [10, 70, 200],  # across blocks, first in block 0
        [130, 3 + 64 * 4, 131],  # first in block 2, another in block 4
        [65, 1],  # same lane (1 and 1 + 64) in different blocks
        [7, 5, 6],  # adjacent, inside one block
        [299, 298],  # in the last, partial block
        [64, 128, 192, 256],  # first lane of every block
    ]
    rows = torch.randn(len(tie_sets), V, generator=torch.Generator().manual_seed(7)).clamp(-3, 3)
    for r, idx in enumerate(tie_sets):
        rows[r, idx] = 5.0
    # Plus a row that is entirely -inf (torch.argmax says 0) and an all-equal row.
    rows = dev(torch.cat([rows, torch.full((1, V), -float("inf")), torch.full((1, V), 2.5)]).to(dtype))
    n_rows = rows.shape[0]
    want = rows.argmax(dim=-1)
    assert want.tolist() == [min(s) for s in tie_sets] + [0, 0]

    # One sequence whose k+1 rows are these rows, drafts = the expected argmax, so
    # everything is accepted iff the kernel's argmax agrees on every row.
    K = n_rows - 1
    na, out = check_kernel(rows, want[:K].clone(), dev(torch.tensor([K])), block_v=BLOCK_V)
    assert na.tolist() == [K]
    assert out.tolist() == want.tolist()

    # The same rows as separate sequences with no draft: each output is the argmax.
    na, out = check_kernel(rows, dev(torch.empty(0, dtype=torch.int64)),
                           dev(torch.zeros(n_rows, dtype=torch.int64)), block_v=BLOCK_V)
    assert out.tolist() == want.tolist()


@needs_triton
def test_argmax_kernel_covers_every_row():
    # Drive the argmax kernel directly: one program per row, every row written.
    logits, _, cu = make_case([4, 0, 2], 100, seed=16)
    target = dev(torch.full((logits.shape[0],), -7, dtype=torch.int64))
    gv._row_argmax_kernel[(logits.shape[0],)](logits, target, logits.stride(0), 100, BLOCK_V=32)
    assert torch.equal(target, logits.argmax(dim=-1))


@needs_triton
def test_kernel_clamps_out_of_range_cu():
    # The launcher does not check cu's values (that would sync the GPU); the kernel
    # clamps each sequence's span into [0, N], so nothing is read or written out of bounds.
    ks = [0, 3]
    logits, draft, cu = make_case(ks, 60, seed=17, accept_prob=1.0)
    want = greedy_verify_reference(logits, draft, cu)
    # cu = [-4, 9] clamps to [0, 3]: the same spans as the real cu.
    got = greedy_verify_triton(logits, draft, dev(torch.tensor([-4, 9])), block_v=32)
    assert_same(got, want)
    # The reference refuses it.
    with pytest.raises(ValueError, match="non-negative"):
        greedy_verify_reference(logits, draft, dev(torch.tensor([-4, 9])))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype):
    # Coarse values so that low precision creates many ties.
    g = torch.Generator().manual_seed(9)
    ks, V = [4, 4, 2, 0], 190
    logits = dev((torch.randint(0, 6, (sum(ks) + len(ks), V), generator=g).to(torch.float32) * 0.37).to(dtype))
    cu = cu_of(ks)
    target = logits.argmax(dim=-1)
    draft = torch.cat([target[rs:rs + k] for _, k, rs in spans(cu)])
    draft[4 + 2] = (draft[4 + 2] + 1) % V  # sequence 1: one rejection mid-way
    na, out = check_kernel(logits, draft, cu, block_v=64)
    assert na.tolist() == [4, 2, 2, 0]
    for (_, _, rs), n, row in zip(spans(cu), na.tolist(), split(out, cu)):
        assert row[n] == int(target[rs + n])
    # Also the random generator path.
    logits, draft, cu = make_case([3, 1, 0], 100, seed=10, dtype=dtype)
    check_kernel(logits, draft, cu, block_v=32)


@needs_triton
def test_nan_follows_torch_argmax():
    V = 130
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(11))
    logits[0, 100] = float("nan")  # torch.argmax picks the first NaN
    logits[0, 90] = float("nan")
    logits[1, 0] = float("nan")
    logits[3, 129] = float("nan")  # a sequence of its own with no draft
    logits = dev(logits)
    target = logits.argmax(dim=-1)
    assert target[0] == 90 and target[1] == 0 and target[3] == 129
    na, out = check_kernel(logits, target[:2].clone(), dev(torch.tensor([2, 2])), block_v=64)
    assert na.tolist() == [2, 0] and out.tolist() == target.tolist()


@needs_triton
def test_int32_inputs_and_non_contiguous_logits():
    ks, V = [3, 0, 2], 100
    big, _, cu = make_case(ks, V + 37, seed=12)
    logits = big[:, :V]  # row stride V + 37, unit stride along V
    assert not logits.is_contiguous()
    target = logits.argmax(-1)
    draft = torch.cat([target[rs:rs + k] for _, k, rs in spans(cu)])
    draft[1] = (draft[1] + 1) % V
    want = check_kernel(logits, draft, cu, block_v=32)
    assert want[0].tolist() == [1, 0, 2]
    assert_same(greedy_verify_triton(logits, draft.int(), cu.int(), block_v=32), want)
    assert_same(greedy_verify_reference(logits, draft.int(), cu.int()), want)
    # Transposed storage (stride along V != 1) is made contiguous by the launcher.
    t = logits.t().contiguous().t()
    assert t.stride(1) != 1
    assert_same(greedy_verify_triton(t, draft, cu, block_v=32), want)


def test_dispatch_matches_reference():
    # The reference on CPU; the kernel on CUDA. Same answer either way.
    logits, draft, cu = make_case([3, 0, 2, 1], 80, seed=13)
    assert_same(greedy_verify(logits, draft, cu), greedy_verify_reference(logits, draft, cu))


# --------------------------------------------------------------------------- #
# reference vs plain Python loops
# --------------------------------------------------------------------------- #


def test_reference_matches_loop_oracles_many_seeds():
    for seed in range(200):
        g = torch.Generator().manual_seed(10_000 + seed)
        B = int(torch.randint(1, 5, (1,), generator=g))
        K = int(torch.randint(0, 6, (1,), generator=g))
        V = int(torch.randint(1, 12, (1,), generator=g))  # small V: frequent ties and matches
        accept_prob = float(torch.rand(1, generator=g))
        logits, draft, cu = make_case(random_ks(B, K, seed), V, seed=seed, accept_prob=accept_prob)
        if seed % 3 == 0:  # integer-valued logits: many ties
            logits = logits.round()
        want = greedy_verify_reference(logits, draft, cu)
        assert_same(loop_oracle(logits.cpu(), draft.cpu(), cu.cpu()), want)
        assert_same(per_sequence_oracle(greedy_verify_reference, logits, draft, cu), want)


def test_reference_known_example():
    # V = 4; targets of the four rows used for every sequence are 2, 1, 3, 0.
    rows = torch.tensor(
        [
            [0.0, 1.0, 5.0, 5.0],  # tie -> 2
            [0.0, 9.0, 1.0, 2.0],
            [0.0, 0.0, 0.0, 1.0],
            [7.0, 0.0, 0.0, 0.0],
        ]
    )
    ks = [3, 3, 1, 2, 0]
    logits = dev(torch.cat([rows[:k + 1] for k in ks]))
    draft = dev(torch.tensor([2, 1, 3] + [2, 0, 3] + [1] + [2, 1]))
    na, out = greedy_verify_reference(logits, draft, cu_of(ks))
    assert na.tolist() == [3, 1, 0, 2, 0]
    assert split(out, cu_of(ks)) == [[2, 1, 3, 0], [2, 1, -1, -1], [2, -1], [2, 1, 3], [2]]


# --------------------------------------------------------------------------- #
# input checks
# --------------------------------------------------------------------------- #


def _good():
    # Two sequences with k = 3 and 1: N = 4, B = 2, 6 rows.
    return dev(torch.randn(6, 10), torch.zeros(4, dtype=torch.int64), torch.tensor([3, 4]))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda l, d, n: (l[0], d, n), r"logits must be \[N \+ B, V\]"),
        (lambda l, d, n: (l.long(), d, n), "floating-point"),
        (lambda l, d, n: (l[:, :0], d, n), "V >= 1"),
        (lambda l, d, n: (l, d.unsqueeze(0), n), "draft_tokens must be 1-D"),
        (lambda l, d, n: (l, d, n.unsqueeze(0)), "cu_num_draft_tokens must be 1-D"),
        (lambda l, d, n: (l, d.float(), n), "draft_tokens must be int64 or int32"),
        (lambda l, d, n: (l, d, n.float()), "cu_num_draft_tokens must be int64 or int32"),
        (lambda l, d, n: (l[:-1], d, n), r"logits must have N \+ B = 4 \+ 2 = 6 rows"),
        (lambda l, d, n: (l, d[:3], n), r"N \+ B = 3 \+ 2 = 5 rows"),
        (lambda l, d, n: (l, d, n[:1]), r"N \+ B = 4 \+ 1 = 5 rows"),
        (lambda l, d, n: (l[:4], d, n[:0]), "draft_tokens must be empty"),
        (lambda l, d, n: (l, d.to("meta"), n), "same device"),
        (lambda l, d, n: (l, d.tolist(), n), "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("fn", ["reference", "triton"])
def test_shape_and_dtype_checks(mutate, match, fn):
    if fn == "triton" and not gv.HAVE_TRITON:
        pytest.skip("triton is not installed")
    f = greedy_verify_reference if fn == "reference" else greedy_verify_triton
    with pytest.raises(ValueError, match=match):
        f(*mutate(*_good()))


@needs_triton
def test_triton_specific_checks():
    l, d, n = _good()
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        greedy_verify_triton(l.double(), d, n)
    with pytest.raises(ValueError, match="block_v must be a positive power of two"):
        greedy_verify_triton(l, d, n, block_v=48)
    with pytest.raises(ValueError, match="block_k must be a positive power of two"):
        greedy_verify_triton(l, d, n, block_k=0)
    with pytest.raises(ValueError, match="CUDA"):
        greedy_verify_triton(l.to("meta"), d.to("meta"), n.to("meta"))


@pytest.mark.parametrize(
    "cu,match",
    [
        ([-1, 4], "non-negative"),
        ([3, 2], "non-decreasing"),  # N = 4 rows still match: 6 = 4 + 2
        ([1, 3], r"end at N = draft_tokens.shape\[0\] = 4"),
        ([5, 5], r"end at N"),
    ],
)
def test_reference_checks_cu_values(cu, match):
    l, d, _ = _good()
    with pytest.raises(ValueError, match=match):
        greedy_verify_reference(l, d, dev(torch.tensor(cu)))


# --------------------------------------------------------------------------- #
# without triton
# --------------------------------------------------------------------------- #


def test_module_imports_and_falls_back_without_triton(monkeypatch):
    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    spec = importlib.util.spec_from_file_location("_greedy_verify_no_triton", gv.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(builtins, "__import__", real_import)
    sys.modules.pop("_greedy_verify_no_triton", None)

    assert not mod.HAVE_TRITON
    logits, draft, cu = make_case([2, 0, 1], 20, seed=14)
    assert_same(mod.greedy_verify(logits, draft, cu), greedy_verify_reference(logits, draft, cu))
    with pytest.raises(RuntimeError, match="triton"):
        mod.greedy_verify_triton(logits, draft, cu)


def test_math_sanity_of_make_case():
    # The generator really produces a mix of outcomes (guards the other tests' strength).
    ks = random_ks(64, 6, 15)
    logits, draft, cu = make_case(ks, 40, seed=15)
    na, _ = greedy_verify_reference(logits, draft, cu)
    k = torch.tensor(ks, device=DEVICE)
    assert (na == k).any() and (na < k).any() and (k == 0).any()
