"""Test helpers: the tiny model and the slow exactness oracle."""

from __future__ import annotations

import math
import re
from collections import Counter

import torch

# The ``greedy`` fixture's request (tests/conftest.py): the tests of origin colours and spans
# send the tiny model's own answer to it as the prediction.
GREEDY_PROMPT = "def total(items):\n    result = 0\n"
GREEDY_TOKENS = 24


def build_tiny_gemma(tokenizer, seed: int = 0):
    """A 4-layer Gemma 3 with the real 262k vocabulary and a short sliding window (8), so that
    the sliding-window path is exercised on short prompts.

    Embedding rows of all tokens but plain ASCII words, punctuation and whitespace are zeroed,
    so the random model writes (meaningless) ASCII text instead of rare unicode: text whose
    re-tokenisation exercises the seams the prediction aligner must handle.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=4096, initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    plain = re.compile(r"^(▁?[A-Za-z]{1,8}|▁?[.,:;()=+\-*/\"'{}\[\]]|▁+|\n+)$")
    keep = torch.zeros(config.vocab_size, dtype=torch.bool)
    for token, index in tokenizer.get_vocab().items():
        if index < config.vocab_size and plain.match(token):
            keep[index] = True
    keep[tokenizer.eos_token_id] = True
    with torch.no_grad():
        model.get_input_embeddings().weight[~keep] = 0.0
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@torch.inference_mode()
def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The slow oracle: transformers' own greedy decoding."""
    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
    )
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def top2_gap(model, ids: list[int]) -> float:
    """Gap between the two largest next-token logits after ``ids`` (one full forward)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def _assert_parts_at_near_tie(got: list[int], expected: list[int], gap_at, tie_epsilon: float, what: str):
    """``got`` equals ``expected``, or they part where ``gap_at(first)`` (the top-2 logit gap
    after ``expected[:first]``) is below ``tie_epsilon``."""
    if got == expected:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if first is None:
        raise AssertionError(
            f"lengths differ without a differing token: got {len(got)}, expected {len(expected)}"
        )
    gap = gap_at(first)
    assert gap < tie_epsilon, (
        f"output differs from {what} at token {first} ({got[first]} vs {expected[first]}) "
        f"with a top-2 logit gap of {gap:.3g}: not a near tie"
    )


def assert_greedy_equal(model, prompt_ids, got: list[int], expected: list[int], tie_epsilon: float):
    """``got`` must equal ``expected`` token for token, except that the two may part at a near
    tie: where they first differ, the target's top-2 logit gap must be below ``tie_epsilon``
    (batched verification changes matmul shapes, so exact ties can flip). Anything else fails."""
    _assert_parts_at_near_tie(got, expected, lambda first: top2_gap(model, list(prompt_ids) + expected[:first]),
                              tie_epsilon, "greedy")


def assert_equal_to_own_plain(engine, prompt_ids, got: list[int], plain: list[int], tie_epsilon: float):
    """The promise of the bf16/fp16 and quantized precisions: speculative tokens ``got`` equal
    the same engine's plain decoding ``plain`` (same precision, no drafts), except that they may
    part at a near tie: where they first differ, the plain run's top-2 logit gap must be below
    ``tie_epsilon``. Anything else fails."""
    from foretell.proxy.engine import GenerationRequest

    def gap_at(first: int) -> float:
        # In this precision, the plain context as the prompt, one token. (Not a replay of the
        # plain request: a cached prompt prefix changes the pass's shapes, and in bf16 that
        # alone can move a near tie.)
        at = engine.generate(GenerationRequest(prompt_ids=list(prompt_ids) + plain[:first], max_tokens=1,
                                               logprobs=2))
        top = at.logprobs[0].top
        return top[0][1] - top[1][1]

    _assert_parts_at_near_tie(got, plain, gap_at, tie_epsilon, "this precision's plain decoding")


def stop_string_cut(tokenizer, tokens: list[int], stop: str) -> tuple[list[int], str] | None:
    """Where plain decoding with a stop string stops: check the text after every token."""
    for count in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:count], skip_special_tokens=True)
        if stop in text:
            return tokens[:count], text[: text.index(stop)]
    return None


SMALL_ALPHABET = "abcdefghi"


def build_small_vocab_model(seed: int = 0, logit_scale: float = 1.0):
    """A tiny Gemma 3 over a 12-token character vocabulary (pad, eos, bos, 'a'..'i') with a real
    fast tokenizer, so that exact sequence distributions can be enumerated and compared with
    sampled ones. ``logit_scale`` sharpens the random model's distributions."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({char: 3 + i for i, char in enumerate(SMALL_ALPHABET)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>")
    config = Gemma3TextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        initializer_range=0.5, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        final_logit_softcapping=None,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model, tokenizer


def assert_envelope(response, status: int, param=None) -> dict:
    """The error envelope every refusal shares (OpenAI's four fields, a request id); its error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert response.headers["x-request-id"]
    if param is not None:
        assert error["param"] == param, error
    return error


class GrammarOracle:
    """A transformers logits processor holding the output to an llguidance grammar: the slow
    oracle of constrained decoding. It re-derives each step's allowed tokens from the tokens
    generated so far with llguidance's byte-per-token mask (``compute_logit_bias``), another
    path than the engine's bitmasks."""

    def __init__(self, llg_tokenizer, grammar: str, prompt_length: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
        self.prompt_length, self.consumed = prompt_length, 0

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_length:].tolist()
        assert self.matcher.consume_tokens(generated[self.consumed:]), self.matcher.get_error()
        self.consumed = len(generated)
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        width = min(scores.shape[-1], allowed.shape[0])
        masked = torch.full_like(scores, float("-inf"))
        masked[:, :width] = scores[:, :width].masked_fill(~allowed[:width].to(scores.device), float("-inf"))
        return masked


@torch.inference_mode()
def constrained_greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, llg_tokenizer,
                                 grammar: str, eos_ids) -> list[int]:
    """transformers' greedy decoding under ``GrammarOracle``, ending on any of ``eos_ids``."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
        logits_processor=LogitsProcessorList([GrammarOracle(llg_tokenizer, grammar, len(prompt_ids))]),
        eos_token_id=sorted(eos_ids),
    )
    tokens = out[0, len(prompt_ids):].tolist()
    return tokens


ALPHA_Z = 3.09  # one-sided normal quantile for alpha = 0.001


def chi_square(counts: Counter, expected: dict[tuple, float], n: int) -> tuple[float, float]:
    """(statistic, critical value at alpha = 0.001); cells expected below 5 are pooled."""
    stat, pooled_observed, pooled_expected, cells = 0.0, 0, 0.0, 0
    for outcome, p in expected.items():
        e = p * n
        if e >= 5:
            stat += (counts.get(outcome, 0) - e) ** 2 / e
            cells += 1
        else:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += e
    unexpected = sum(c for outcome, c in counts.items() if outcome not in expected)
    assert unexpected == 0, "the engine emitted a sequence of probability zero"
    if pooled_expected > 0:
        stat += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    df = cells - 1
    critical = df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat, critical


# ---- the sampling oracle: exact distributions of a small-vocabulary model -------------------

SAMPLES = 3000  # seeded requests per distribution test


@torch.inference_mode()
def next_probs(model, ids, temperature, top_k=None, top_p=1.0) -> torch.Tensor:
    from foretell.proxy.engine.sampling import target_probs

    logits = model(input_ids=torch.tensor([ids])).logits[0, -1:]
    return target_probs(logits, temperature, top_k, top_p)[0]


def exact_distribution(model, prompt_ids, length, eos, **sampling_args) -> dict[tuple, float]:
    """P(first ``length`` tokens), a sequence ending early at EOS (as the engine stops there)."""
    result = {}

    def walk(prefix, mass):
        if len(prefix) == length or (prefix and prefix[-1] == eos):
            result[tuple(prefix)] = result.get(tuple(prefix), 0.0) + mass
            return
        probs = next_probs(model, prompt_ids + prefix, **sampling_args)
        for token, p in enumerate(probs.tolist()):
            if p > 0:
                walk(prefix + [token], mass * p)

    walk([], 1.0)
    return result


def sample_many(engine, prompt_ids, prediction, n=None, batch=16, **sampling_args):
    """The first three tokens of ``n`` requests seeded 0..n-1, ``batch`` of them in flight in each
    target pass (the engine's batched step, as the server runs it: each sequence draws from its
    own seeded generator, so a sample's distribution does not depend on its neighbours), which
    takes a sixteenth of the passes one request at a time would."""
    from foretell.proxy.engine import GenerationRequest

    counts, drafted, accepted = Counter(), 0, 0
    seeds, running = iter(range(SAMPLES if n is None else n)), []
    while True:
        while len(running) < batch and (seed := next(seeds, None)) is not None:
            seq = engine.add(GenerationRequest(prompt_ids=prompt_ids, max_tokens=3, prediction=prediction,
                                               prompt_lookup=False, seed=seed, **sampling_args))
            assert seq is not None, "the KV cache should hold a batch of three-token requests"
            running.append(seq)
        if not running:
            return counts, drafted, accepted
        for update in engine.step(running):
            if update.error is not None:
                raise update.error
            if update.result is not None:
                running.remove(update.sequence)
                counts[tuple(update.result.token_ids)] += 1
                drafted += update.result.stats.drafted_tokens
                accepted += update.result.stats.accepted_tokens
