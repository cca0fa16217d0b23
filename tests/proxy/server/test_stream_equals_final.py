"""A stream and the final answer are the same text, piece by piece.

Over real HTTP (the tiny model's server in process, both endpoints, greedy): the streamed pieces
joined equal the non-streamed text of the same request, with and without a prediction (a
unicode-heavy one, and the answer itself) and with and without a stop string that spans tokens;
no streamed piece is ever contradicted later (every partial join is a prefix of the final text).

The tiny model writes mostly ASCII, so the engine-level tests below use a model built to write
byte-fallback tokens (a fixed cycle of them) to check the same on half-written characters, and
one test runs the real embedded model on unicode.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from tests.helpers import stop_string_cut

REPLACEMENT = "\ufffd"
MODEL = "tiny"
MAX_TOKENS = 12
PROMPTS = [
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩\u200d👩\u200d👧 שלום:",
    "def f(x):  # 漢字 cafe\u0301 مرحبا\n    return",
]
UNICODE_PREDICTION = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🇫🇷🇯🇵 👩\u200d👩\u200d👧 שלום עולם e\u0301 漢字テスト ꙮ ∑ "


# ---- over HTTP -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_server):
    """A client of the shared in-process server on the tiny model (tests/conftest.py)."""
    with httpx.Client(base_url=tiny_server.base + "/v1", timeout=120) as client:
        yield client


def body_for(endpoint: str, prompt: str, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def path_of(endpoint: str) -> str:
    return "/chat/completions" if endpoint == "chat" else "/completions"


def final(client, endpoint: str, body: dict) -> dict:
    response = client.post(path_of(endpoint), json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    return {"text": text, "finish_reason": choice["finish_reason"], "logprobs": choice["logprobs"]}


def streamed(client, endpoint: str, body: dict) -> tuple[list[str], str]:
    """The text pieces of a stream, in order, and its finish reason."""
    pieces, finish = [], None
    with client.stream("POST", path_of(endpoint), json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            assert "error" not in payload, payload
            for choice in payload["choices"]:
                piece = choice["delta"].get("content") if endpoint == "chat" else choice["text"]
                if piece:
                    pieces.append(piece)
                finish = choice["finish_reason"] or finish
    return pieces, finish


def check_stream(client, endpoint: str, body: dict) -> dict:
    """The stream of ``body`` equals its non-streamed answer; return that answer. The two run at
    once (batched into the same passes), which greedy decoding must not notice."""
    with ThreadPoolExecutor(2) as pool:
        answer = pool.submit(final, client, endpoint, body)
        pieces, finish = streamed(client, endpoint, body)
        expected = answer.result()
    joined = ""
    for i, piece in enumerate(pieces):
        joined += piece
        assert expected["text"].startswith(joined), (
            f"streamed piece {i} {piece!r} is not in the final text {expected['text']!r} ({body})")
        if REPLACEMENT not in expected["text"]:
            assert REPLACEMENT not in piece
    assert joined == expected["text"], body
    assert finish == expected["finish_reason"]
    return expected


def token_texts(endpoint: str, answer: dict) -> list[str]:
    if endpoint == "chat":
        return [item["token"] for item in answer["logprobs"]["content"]]
    return answer["logprobs"]["tokens"]


def spanning_stop(tokens: list[str]) -> str:
    """A stop string made of the end of one generated token and the start of the next."""
    for i in range(len(tokens) // 2, len(tokens) - 1):
        if tokens[i].strip() and tokens[i + 1].strip():
            return tokens[i][-2:] + tokens[i + 1][:2]
    raise AssertionError(f"no two neighbouring tokens with text: {tokens}")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["fraktur-emoji-hebrew", "code-cjk-arabic"])
def test_stream_equals_final(server, endpoint, prompt):
    logprobs = {"logprobs": True, "top_logprobs": 0} if endpoint == "chat" else {"logprobs": 0}
    plain = check_stream(server, endpoint, body_for(endpoint, prompt, **logprobs))
    tokens = token_texts(endpoint, plain)
    assert len(tokens) >= 4
    stop = spanning_stop(tokens)
    answer_prediction = {"type": "content", "content": plain["text"]}
    unicode_prediction = {"type": "content", "content": UNICODE_PREDICTION + plain["text"][:10]}
    variants = [
        {"prediction": unicode_prediction},
        {"prediction": answer_prediction},
        {"stop": [stop]},
        {"prediction": answer_prediction, "stop": [stop]},
        {"prediction": unicode_prediction, "stop": [stop, "𝔫𝔦"]},
    ]
    with ThreadPoolExecutor(len(variants)) as pool:
        answers = list(pool.map(lambda fields: check_stream(server, endpoint, body_for(endpoint, prompt, **fields)),
                                variants))
    for fields, answer in zip(variants, answers):
        if "stop" in fields:
            # Greedy: the stopped answer is the plain one cut where the stop starts.
            assert answer["text"] == plain["text"][: plain["text"].index(stop)]
            assert answer["finish_reason"] == "stop"
        else:
            assert answer["text"] == plain["text"]


def test_stop_spanning_two_words_sends_nothing_past_the_cut(server):
    """The issue's shape: a stop string starting inside one word token and ending in the next
    ({"stop": ["the capital of"]} answered " " but streamed " the", " capital"), on the tiny model
    without a prediction, so that every token is its own round."""
    prompt = "The capital of France is"
    plain = final(server, "completions", body_for("completions", prompt, max_tokens=8, logprobs=0))
    tokens = plain["logprobs"]["tokens"]
    i = next(i for i in range(len(tokens) - 1)
             if tokens[i].startswith(" ") and len(tokens[i]) > 2 and tokens[i + 1].strip())
    stop = tokens[i][1:] + tokens[i + 1]  # like "the capital": the leading space stays in the text
    body = body_for("completions", prompt, max_tokens=8, stop=[stop])
    answer = check_stream(server, "completions", body)
    assert answer["text"] == plain["text"][: plain["text"].index(stop)] and answer["finish_reason"] == "stop"
    assert answer["text"].endswith(" ")  # the shape: the word's leading space is kept
    pieces, _ = streamed(server, "completions", body)
    assert tokens[i] not in pieces and not "".join(pieces).endswith(tokens[i])


# ---- byte-fallback output at engine level ----------------------------------------------------

# 𝔘 (4 bytes), é (2 bytes), ℭ (3 bytes) as byte-fallback tokens, then " z": the greedy cycle.
CYCLE_PIECES = ["<0xF0>", "<0x9D>", "<0x94>", "<0x98>", "<0xC3>", "<0xA9>", "<0xE2>", "<0x84>", "<0xAD>", "▁z"]
CYCLE_TEXT = "𝔘éℭ z"
# 𝔘, then a stray lead byte and " x": invalid UTF-8 that a sampling model can write.
STRAY_PIECES = ["<0xF0>", "<0x9D>", "<0x94>", "<0x98>", "<0xF1>", "▁x"]


def build_cycle_model(tokenizer, pieces: list[str]):
    """A tiny Gemma 3 whose greedy output after ``pieces[-1]`` is ``pieces`` over and over:
    attention and MLP outputs are zeroed, so the logits depend on the current token only, and
    one-hot embeddings with an untied head map each piece to the next."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    ids = tokenizer.convert_tokens_to_ids(pieces)
    assert len(set(ids)) == len(ids) and tokenizer.unk_token_id not in ids
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
        tie_word_embeddings=False, final_logit_softcapping=None,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.get_input_embeddings().weight.zero_()
        model.lm_head.weight.zero_()
        for j, token in enumerate(ids):
            model.get_input_embeddings().weight[token, j] = 1.0
            model.lm_head.weight[ids[(j + 1) % len(ids)], j] = 10.0
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, ids


@pytest.fixture(scope="module")
def cycle_engine(tokenizer):
    model, ids = build_cycle_model(tokenizer, CYCLE_PIECES)
    return SpeculativeEngine(model, tokenizer, kv_cache_tokens=2048), ids


def generate_pieces(engine, request: GenerationRequest):
    pieces = []
    result = engine.generate(request, on_tokens=lambda ids, text, _: pieces.append(text))
    return result, pieces


def assert_pieces_are_the_text(pieces: list[str], text: str, complete_upto: int) -> None:
    """Joined pieces are ``text``; no piece before the end holds U+FFFD where ``text[:complete_upto]``
    has complete characters only."""
    assert "".join(pieces) == text
    joined = ""
    for piece in pieces:
        joined += piece
        assert REPLACEMENT not in joined[:complete_upto], joined


@pytest.mark.parametrize("prediction", [None, "cycle", "unicode"])
def test_byte_fallback_output_streams_whole_characters(cycle_engine, tokenizer, prediction):
    engine, ids = cycle_engine
    predictions = {None: None, "cycle": CYCLE_TEXT * 6, "unicode": UNICODE_PREDICTION + CYCLE_TEXT * 3}
    prompt_ids = [tokenizer.bos_token_id, ids[-1]]
    result, pieces = generate_pieces(engine, GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=4 * len(ids), prediction=predictions[prediction]))
    assert result.token_ids == ids * 4  # the model writes its cycle
    assert result.text == tokenizer.decode(result.token_ids) == CYCLE_TEXT * 4
    assert_pieces_are_the_text(pieces, result.text, len(result.text))
    assert len([p for p in pieces if p]) > 1  # streamed, not one blob at the end
    if prediction == "cycle":
        assert result.stats.accepted_tokens > 0  # byte tokens were accepted from the prediction


def test_byte_fallback_output_cut_mid_character(cycle_engine, tokenizer):
    engine, ids = cycle_engine
    result, pieces = generate_pieces(engine, GenerationRequest(
        prompt_ids=[tokenizer.bos_token_id, ids[-1]], max_tokens=len(ids) + 3, prediction=CYCLE_TEXT * 3))
    assert result.token_ids == ids + ids[:3]  # ends inside 𝔘
    assert result.text == tokenizer.decode(result.token_ids)
    assert result.text.startswith(CYCLE_TEXT) and result.text.endswith(REPLACEMENT)
    assert_pieces_are_the_text(pieces, result.text, len(CYCLE_TEXT))


def test_byte_fallback_output_cut_right_after_a_byte_written_character(cycle_engine, tokenizer):
    """max_tokens ends the output on the first byte of é, right after 𝔘 (all byte tokens): the
    text keeps 𝔘 and shows the unfinished byte as U+FFFD, as when the cut follows plain text."""
    engine, ids = cycle_engine
    result, pieces = generate_pieces(engine, GenerationRequest(
        prompt_ids=[tokenizer.bos_token_id, ids[-1]], max_tokens=5))
    assert result.token_ids == ids[:5]
    assert "".join(pieces) == result.text
    assert result.text.startswith("𝔘") and result.text.endswith(REPLACEMENT), (
        f"the unfinished byte was dropped: {result.text!r}")


@pytest.mark.parametrize("stop", ["ℭ z𝔘é", "z𝔘", "é"], ids=["across-cycle", "space-to-4-bytes", "2-bytes"])
@pytest.mark.parametrize("prediction", [None, CYCLE_TEXT * 5], ids=["plain", "predicted"])
def test_byte_fallback_stop_strings(cycle_engine, tokenizer, stop, prediction):
    engine, ids = cycle_engine
    prompt_ids = [tokenizer.bos_token_id, ids[-1]]
    expected_tokens, expected_text = stop_string_cut(tokenizer, ids * 3, stop)
    result, pieces = generate_pieces(engine, GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=3 * len(ids), prediction=prediction, stop=(stop,)))
    assert result.token_ids == expected_tokens
    assert result.text == expected_text
    assert result.finish_reason == "stop"
    assert_pieces_are_the_text(pieces, result.text, len(result.text))


def test_stray_byte_does_not_swallow_the_rest_of_the_output(tokenizer):
    """𝔘, a stray lead byte, " x", over and over: invalid UTF-8, which the byte-run decoder turns
    into U+FFFDs as a whole. The text after each stray byte must still come out, and a stop
    string after it must still stop the generation."""
    model, ids = build_cycle_model(tokenizer, STRAY_PIECES)
    engine = SpeculativeEngine(model, tokenizer, kv_cache_tokens=2048)
    prompt_ids = [tokenizer.bos_token_id, ids[-1]]
    result, pieces = generate_pieces(engine, GenerationRequest(prompt_ids=prompt_ids, max_tokens=3 * len(ids)))
    assert result.token_ids == ids * 3
    assert "".join(pieces) == result.text
    assert result.text.count(" x") == 3, f"text after the stray bytes lost: {result.text!r}"
    stopped = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=3 * len(ids), stop=(" x",)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == ids, stopped.token_ids


# ---- the real embedded model ---------------------------------------------------------------

@pytest.mark.embedded
def test_embedded_unicode_stream_equals_final(embedded):
    """The real model continuing fraktur (byte-fallback tokens) after emoji (whole tokens):
    streamed pieces are the text, with and without its own text as the prediction."""
    engine = SpeculativeEngine(embedded.model, embedded.tokenizer, kv_cache_tokens=4096)
    tokenizer = embedded.tokenizer
    prompt = ("Emoji: 👩\u200d👩\u200d👧 🇫🇷 🧬 🫠 👩\u200d👩\u200d👧 🇫🇷 🧬\n"
              "Mathematical fraktur: 𝔄𝔅ℭ𝔇𝔈𝔉 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔘𝔫𝔦")
    prompt_ids = tokenizer(prompt)["input_ids"]
    plain, plain_pieces = generate_pieces(engine, GenerationRequest(prompt_ids=prompt_ids, max_tokens=18))
    predicted, predicted_pieces = generate_pieces(engine, GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=18, prediction=plain.text))
    assert predicted.token_ids == plain.token_ids and predicted.text == plain.text
    assert predicted.stats.accepted_tokens > 0
    assert any(tokenizer.convert_ids_to_tokens(t).startswith("<0x") for t in plain.token_ids)
    assert not plain.text.isascii()
    # The text is plain decoding's up to the last complete character.
    complete = max((tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True)
                    for k in range(len(plain.token_ids) + 1)
                    if REPLACEMENT not in tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True)),
                   key=len)
    assert plain.text.startswith(complete)
    for pieces in (plain_pieces, predicted_pieces):
        assert_pieces_are_the_text(pieces, plain.text, len(complete))
