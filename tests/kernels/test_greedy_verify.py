"""Tests for foretell.kernels.greedy_verify.

The Triton kernel is run through Triton's interpreter on CPU tensors, so the
environment variable must be set before triton / foretell.kernels are imported:
``triton.jit`` decides at decoration time (i.e. when triton.language and the
kernel module are imported) whether it builds an interpreted or a compiled
function.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import builtins  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import foretell.kernels  # noqa: E402

# `foretell.kernels.greedy_verify` as an attribute is the *function* re-exported by
# the package __init__, so the module has to be taken from sys.modules.
gv = importlib.import_module("foretell.kernels.greedy_verify")


@pytest.fixture
def interpreter_active():
    # TRITON_INTERPRET is read when `triton` itself is imported (triton.language's
    # own helpers such as tl.max are @jit functions too) and when our kernels are
    # decorated. If anything imported triton before this module set the variable,
    # the kernels are compiled ones and cannot run on CPU tensors; reloading our
    # module does not help because triton.language stays compiled.
    if not gv._kernels_interpreted():
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
    assert torch.equal(na_g, na_w), f"num_accepted {na_g.tolist()} != {na_w.tolist()}"
    assert torch.equal(out_g, out_w), f"output_tokens\n{out_g}\n!=\n{out_w}"


def check_kernel(logits, draft, num_draft, **kw):
    """Kernel == reference, exactly. Returns the reference result."""
    want = greedy_verify_reference(logits, draft, num_draft)
    got = greedy_verify_triton(logits, draft, num_draft, **kw)
    assert_same(got, want)
    return want


def first_max_index(values):
    """First index of the maximum of a list of (non-NaN) floats, in plain Python."""
    best_i, best_v = 0, values[0]
    for i, v in enumerate(values):
        if v > best_v:
            best_i, best_v = i, v
    return best_i


def loop_oracle(logits, draft, num_draft):
    """Hand-written greedy verify: walk the positions, compare draft with argmax."""
    B, K1, _ = logits.shape
    num_accepted, outputs = [], []
    for b in range(B):
        n = int(num_draft[b])
        row = []
        for j in range(n + 1):
            t = first_max_index(logits[b, j].tolist())
            row.append(t)
            if j == n or int(draft[b, j]) != t:
                break
        num_accepted.append(len(row) - 1)
        outputs.append(row + [-1] * (K1 - len(row)))
    return (
        torch.tensor(num_accepted, dtype=torch.int64),
        torch.tensor(outputs, dtype=torch.int64).reshape(B, K1),
    )


def make_case(B, K, V, *, seed, accept_prob=0.7, dtype=torch.float32, garbage=True, num_draft=None):
    """Random logits, and drafts that follow the target's argmax with probability
    accept_prob per position (else a random token), padded with -1. Padding rows
    of the logits get NaN/inf garbage when `garbage`."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
    if num_draft is None:
        num_draft = torch.randint(0, K + 1, (B,), generator=g)
    num_draft = torch.as_tensor(num_draft, dtype=torch.int64)
    target = logits.argmax(dim=-1)
    random_tokens = torch.randint(0, V, (B, K), generator=g)
    follow = torch.rand(B, K, generator=g) < accept_prob
    draft = torch.where(follow, target[:, :K], random_tokens)
    pos = torch.arange(K + 1)
    draft[pos[:K].unsqueeze(0) >= num_draft.unsqueeze(1)] = -1
    if garbage:
        pad_rows = pos.unsqueeze(0) > num_draft.unsqueeze(1)  # [B, K+1]
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4], dtype=torch.float32)
        fill = junk[torch.randint(0, 4, (B, K + 1, V), generator=g)].to(dtype)
        logits = torch.where(pad_rows.unsqueeze(-1), fill, logits)
    return logits, draft, num_draft


# --------------------------------------------------------------------------- #
# setup
# --------------------------------------------------------------------------- #


@needs_triton
def test_kernels_run_in_interpreter_on_cpu():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(gv._row_argmax_kernel).__name__ == "InterpretedFunction"
    assert type(gv._accept_kernel).__name__ == "InterpretedFunction"
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, 3] = 1.0
    logits[0, 1, 6] = 1.0
    na, out = greedy_verify_triton(logits, torch.tensor([[3]]), torch.tensor([1]))
    assert na.device.type == "cpu"
    assert na.tolist() == [1] and out.tolist() == [[3, 6]]


def test_package_exports():
    assert foretell.kernels.greedy_verify_reference is greedy_verify_reference
    assert foretell.kernels.greedy_verify_triton is greedy_verify_triton
    assert foretell.kernels.greedy_verify is greedy_verify


# --------------------------------------------------------------------------- #
# kernel == reference
# --------------------------------------------------------------------------- #


@needs_triton
@pytest.mark.parametrize(
    "B,K,V,block_v",
    [
        (4, 5, 50, 1024),  # one block, mostly masked
        (3, 4, 129, 64),  # V not a multiple of BLOCK_V, three blocks
        (5, 6, 300, 64),  # five blocks, last one partial
        (2, 3, 256, 64),  # exact multiple of BLOCK_V
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_matches_reference(B, K, V, block_v, seed):
    logits, draft, nd = make_case(B, K, V, seed=seed)
    check_kernel(logits, draft, nd, block_v=block_v)


@needs_triton
@pytest.mark.parametrize("block_v", [32, 1024])
def test_all_accepted_bonus_token(block_v):
    B, K, V = 3, 4, 200
    logits, _, _ = make_case(B, K, V, seed=3, garbage=False)
    target = logits.argmax(dim=-1)
    draft = target[:, :K].clone()
    nd = torch.full((B,), K)
    na, out = check_kernel(logits, draft, nd, block_v=block_v)
    assert na.tolist() == [K] * B
    assert torch.equal(out, target)  # K accepted drafts + bonus target[K]


@needs_triton
def test_first_draft_rejected():
    B, K, V = 3, 4, 120
    logits, _, _ = make_case(B, K, V, seed=4, garbage=False)
    target = logits.argmax(dim=-1)
    draft = target[:, :K].clone()
    draft[:, 0] = (target[:, 0] + 1) % V
    nd = torch.tensor([4, 1, 2])
    draft[1, 1:] = -1
    draft[2, 2:] = -1
    na, out = check_kernel(logits, draft, nd, block_v=64)
    assert na.tolist() == [0, 0, 0]
    assert out[:, 0].tolist() == target[:, 0].tolist()  # recovered token
    assert (out[:, 1:] == -1).all()


@needs_triton
def test_empty_drafts():
    # num_draft == 0 with K > 0: only row 0 counts, the rest is garbage.
    logits, draft, nd = make_case(3, 3, 90, seed=5, num_draft=[0, 0, 0])
    assert (draft == -1).all()
    na, out = check_kernel(logits, draft, nd, block_v=64)
    assert na.tolist() == [0, 0, 0]
    assert out[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()
    assert (out[:, 1:] == -1).all()

    # K == 0: draft_tokens is [B, 0]; the output is the single bonus token.
    logits = torch.randn(4, 1, 70, generator=torch.Generator().manual_seed(6))
    draft = torch.empty(4, 0, dtype=torch.int64)
    nd = torch.zeros(4, dtype=torch.int64)
    na, out = check_kernel(logits, draft, nd, block_v=32)
    assert na.tolist() == [0] * 4
    assert out.shape == (4, 1) and out[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()


@needs_triton
def test_empty_batch():
    logits = torch.randn(0, 3, 10)
    draft = torch.empty(0, 2, dtype=torch.int64)
    nd = torch.empty(0, dtype=torch.int64)
    na, out = greedy_verify_triton(logits, draft, nd)
    assert na.shape == (0,) and out.shape == (0, 3)
    assert_same((na, out), greedy_verify_reference(logits, draft, nd))


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
    rows = torch.cat([rows, torch.full((1, V), -float("inf")), torch.full((1, V), 2.5)]).to(dtype)
    n_rows = rows.shape[0]
    want = rows.argmax(dim=-1)
    assert want.tolist() == [min(s) for s in tie_sets] + [0, 0]

    # One request whose K+1 rows are these rows, drafts = the expected argmax, so
    # everything is accepted iff the kernel's argmax agrees on every row.
    logits = rows.unsqueeze(0)
    K = n_rows - 1
    draft = want[:K].unsqueeze(0).clone()
    nd = torch.tensor([K])
    na, out = check_kernel(logits, draft, nd, block_v=BLOCK_V)
    assert na.tolist() == [K]
    assert out[0].tolist() == want.tolist()

    # Same rows as row 0 of separate requests with no draft: each output is the argmax.
    logits = rows.unsqueeze(1)  # [n_rows, 1, V]
    na, out = check_kernel(logits, torch.empty(n_rows, 0, dtype=torch.int64), torch.zeros(n_rows, dtype=torch.int64), block_v=BLOCK_V)
    assert out[:, 0].tolist() == want.tolist()


@needs_triton
def test_ragged_batch_with_garbage_padding():
    B, K, V = 5, 5, 150
    nd = torch.tensor([5, 0, 2, 3, 1])
    logits, draft, nd = make_case(B, K, V, seed=8, num_draft=nd, accept_prob=0.9)
    # Make the padding rows hostile: NaN everywhere except one huge spike.
    pos = torch.arange(K + 1)
    pad = pos.unsqueeze(0) > nd.unsqueeze(1)
    assert pad.any()
    logits[pad] = float("nan")
    logits[pad.nonzero(as_tuple=True) + (torch.zeros(int(pad.sum()), dtype=torch.long),)] = 1e30
    na, out = check_kernel(logits, draft, nd, block_v=64)
    assert (na <= nd).all()
    assert ((out != -1).sum(dim=1) == na + 1).all()
    # Compare with the loop oracle too (it never reads padding rows).
    assert_same((na, out), loop_oracle(logits, draft, nd))


@needs_triton
def test_argmax_kernel_skips_padding_rows():
    # Drive the argmax kernel directly: rows j > num_draft[b] must stay untouched.
    B, K, V = 3, 4, 100
    logits, _, nd = make_case(B, K, V, seed=16, num_draft=[4, 0, 2])
    target = torch.full((B, K + 1), -7, dtype=torch.int64)
    gv._row_argmax_kernel[(B, K + 1)](logits, nd, target, logits.stride(0), logits.stride(1), K, V, BLOCK_V=32)
    pad = torch.arange(K + 1).unsqueeze(0) > nd.unsqueeze(1)
    assert (target[pad] == -7).all()
    assert torch.equal(target[~pad], logits.argmax(dim=-1)[~pad])


@needs_triton
def test_kernel_clamps_out_of_range_num_draft():
    # The launcher does not range-check num_draft (that would sync the GPU); the
    # kernels clamp it to [0, K] so nothing is read or written out of bounds.
    logits, draft, _ = make_case(2, 3, 60, seed=17, garbage=False, num_draft=[3, 3])
    draft = logits.argmax(-1)[:, :3].clone()
    got = greedy_verify_triton(logits, draft, torch.tensor([9, -2]), block_v=32)
    assert_same(got, greedy_verify_reference(logits, draft, torch.tensor([3, 0])))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype):
    # Coarse values so that low precision creates many ties.
    g = torch.Generator().manual_seed(9)
    B, K, V = 4, 4, 190
    logits = (torch.randint(0, 6, (B, K + 1, V), generator=g).to(torch.float32) * 0.37).to(dtype)
    target = logits.argmax(dim=-1)
    draft = target[:, :K].clone()
    draft[1, 2] = (draft[1, 2] + 1) % V  # one rejection mid-way
    nd = torch.tensor([4, 4, 2, 0])
    draft[2, 2:] = -1
    draft[3, :] = -1
    na, out = check_kernel(logits, draft, nd, block_v=64)
    assert na.tolist() == [4, 2, 2, 0]
    for b, n in enumerate(na.tolist()):
        assert out[b, n] == target[b, n]
    # Also the random generator path.
    logits, draft, nd = make_case(3, 3, 100, seed=10, dtype=dtype)
    check_kernel(logits, draft, nd, block_v=32)


@needs_triton
def test_nan_in_valid_row_follows_torch_argmax():
    V = 130
    logits = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(11))
    logits[0, 0, 100] = float("nan")  # torch.argmax picks the first NaN
    logits[0, 0, 90] = float("nan")
    logits[0, 1, 0] = float("nan")
    target = logits.argmax(dim=-1)
    assert target[0, 0] == 90 and target[0, 1] == 0
    draft = target[:, :2].clone()
    na, out = check_kernel(logits, draft, torch.tensor([2]), block_v=64)
    assert na.tolist() == [2] and out[0].tolist() == target[0].tolist()


@needs_triton
def test_int32_inputs_and_non_contiguous_logits():
    B, K, V = 3, 3, 100
    big, draft, nd = make_case(B, K, V + 37, seed=12, garbage=False)
    logits = big[:, :, :V]  # row stride V + 37, unit stride along V
    assert not logits.is_contiguous()
    target = logits.argmax(-1)
    draft = torch.where(torch.rand(B, K, generator=torch.Generator().manual_seed(1)) < 0.8, target[:, :K], 0)
    draft[torch.arange(K).unsqueeze(0) >= nd.unsqueeze(1)] = -1
    want = check_kernel(logits, draft, nd, block_v=32)
    assert_same(greedy_verify_triton(logits, draft.int(), nd.int(), block_v=32), want)
    # Transposed storage (stride along V != 1) is made contiguous by the launcher.
    t = logits.transpose(1, 2).contiguous().transpose(1, 2)
    assert t.stride(2) != 1
    assert_same(greedy_verify_triton(t, draft, nd, block_v=32), want)


def test_dispatch_uses_reference_on_cpu():
    logits, draft, nd = make_case(4, 3, 80, seed=13)
    assert_same(greedy_verify(logits, draft, nd), greedy_verify_reference(logits, draft, nd))


# --------------------------------------------------------------------------- #
# reference vs a plain Python loop
# --------------------------------------------------------------------------- #


def test_reference_matches_loop_oracle_many_seeds():
    for seed in range(300):
        g = torch.Generator().manual_seed(10_000 + seed)
        B = int(torch.randint(1, 5, (1,), generator=g))
        K = int(torch.randint(0, 6, (1,), generator=g))
        V = int(torch.randint(1, 12, (1,), generator=g))  # small V: frequent ties and matches
        accept_prob = float(torch.rand(1, generator=g))
        logits, draft, nd = make_case(B, K, V, seed=seed, accept_prob=accept_prob)
        if seed % 3 == 0:  # integer-valued logits: many ties
            logits = torch.where(logits.isnan(), logits, logits.round())
        assert_same(greedy_verify_reference(logits, draft, nd), loop_oracle(logits, draft, nd))


def test_reference_known_example():
    # V = 4, K = 3; targets per row are 2, 1, 3, 0.
    rows = torch.tensor(
        [
            [0.0, 1.0, 5.0, 5.0],  # tie -> 2
            [0.0, 9.0, 1.0, 2.0],
            [0.0, 0.0, 0.0, 1.0],
            [7.0, 0.0, 0.0, 0.0],
        ]
    )
    logits = rows.unsqueeze(0).repeat(4, 1, 1)
    draft = torch.tensor([[2, 1, 3], [2, 0, 3], [1, -1, -1], [2, 1, -1]])
    nd = torch.tensor([3, 3, 1, 2])
    na, out = greedy_verify_reference(logits, draft, nd)
    assert na.tolist() == [3, 1, 0, 2]
    assert out.tolist() == [[2, 1, 3, 0], [2, 1, -1, -1], [2, -1, -1, -1], [2, 1, 3, -1]]


# --------------------------------------------------------------------------- #
# input checks
# --------------------------------------------------------------------------- #


def _good():
    return torch.randn(2, 4, 10), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3, 1])


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda l, d, n: (l[0], d, n), "3-D"),
        (lambda l, d, n: (l.long(), d, n), "floating-point"),
        (lambda l, d, n: (l[:, :0], d[:, :0], n), "K\\+1 >= 1"),
        (lambda l, d, n: (l[:, :, :0], d, n), "vocabulary"),
        (lambda l, d, n: (l, d[:, :2], n), "draft_tokens must have shape"),
        (lambda l, d, n: (l, d[:1], n), "draft_tokens must have shape"),
        (lambda l, d, n: (l, d.float(), n), "draft_tokens must be int64 or int32"),
        (lambda l, d, n: (l, d, n[:1]), "num_draft must have shape"),
        (lambda l, d, n: (l, d, n.unsqueeze(0)), "num_draft must have shape"),
        (lambda l, d, n: (l, d, n.float()), "num_draft must be int64 or int32"),
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


def test_reference_rejects_out_of_range_num_draft():
    l, d, _ = _good()
    with pytest.raises(ValueError, match=r"\[0, K\]"):
        greedy_verify_reference(l, d, torch.tensor([4, 0]))
    with pytest.raises(ValueError, match=r"\[0, K\]"):
        greedy_verify_reference(l, d, torch.tensor([0, -1]))


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
    logits, draft, nd = make_case(3, 2, 20, seed=14)
    assert_same(mod.greedy_verify(logits, draft, nd), greedy_verify_reference(logits, draft, nd))
    with pytest.raises(RuntimeError, match="triton"):
        mod.greedy_verify_triton(logits, draft, nd)


def test_math_sanity_of_make_case():
    # The generator really produces a mix of outcomes (guards the other tests' strength).
    logits, draft, nd = make_case(64, 6, 40, seed=15)
    na, _ = greedy_verify_reference(logits, draft, nd)
    assert (na == nd).any() and (na < nd).any() and (nd == 0).any()
    assert logits[torch.arange(7).unsqueeze(0) > nd.unsqueeze(1)].isnan().any()
