"""Chat logprobs' ``bytes`` with the real Gemma tokenizer: a byte-fallback token carries its own
raw byte (not the UTF-8 of the U+FFFD it decodes to alone), so joining the tokens' bytes gives
the text back, as OpenAI's field promises."""

from __future__ import annotations

from foretell.proxy.engine import TokenLogprob
from foretell.proxy.server.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs

FRAKTUR = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"  # mostly byte-fallback tokens in Gemma's vocabulary


def _entries(ids: list[int]) -> list[TokenLogprob]:
    # Each entry's alternatives: itself and its neighbour in the list, so top_logprobs hold
    # byte-fallback tokens too.
    return [TokenLogprob(t, -0.5, [(t, -0.5), (ids[(i + 1) % len(ids)], -1.5)]) for i, t in enumerate(ids)]


def test_byte_fallback_token_carries_its_raw_byte(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["<0xF0>", "<0x9D>", "<0x94>", "<0x98>"])  # 𝔘
    shaped = chat_logprobs(_entries(ids), TokenTexts(tokenizer))
    content = shaped["content"]
    assert [item["bytes"] for item in content] == [[0xF0], [0x9D], [0x94], [0x98]]
    # The token text stays what decoding the token alone gives.
    assert [item["token"] for item in content] == [tokenizer.decode([t]) for t in ids]
    assert bytes(b for item in content for b in item["bytes"]).decode("utf-8") == "𝔘"
    # Alternatives get the same treatment.
    assert [item["top_logprobs"][1]["bytes"] for item in content] == [[0x9D], [0x94], [0x98], [0xF0]]


def test_joined_bytes_give_back_mixed_text(tokenizer):
    text = f"x = '{FRAKTUR}' # 👩\u200d👩\u200d👧 שלום e\u0301 漢字 ꙮ\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert any(p.startswith("<0x") for p in pieces)  # the case under test is present
    assert any(not p.startswith("<0x") and not p.isascii() for p in pieces)  # and whole unicode tokens
    content = chat_logprobs(_entries(ids), TokenTexts(tokenizer))["content"]
    assert bytes(b for item in content for b in item["bytes"]).decode("utf-8") == tokenizer.decode(ids)
    for token_id, item in zip(ids, content):
        if not tokenizer.convert_ids_to_tokens(token_id).startswith("<0x"):
            assert item["bytes"] == list(item["token"].encode("utf-8"))
        else:
            assert len(item["bytes"]) == 1


def test_completion_logprobs_tokens_unchanged(tokenizer):
    ids = tokenizer("a 𝔘 b", add_special_tokens=False)["input_ids"]
    shaped = completion_logprobs(_entries(ids), TokenTexts(tokenizer))
    assert shaped["tokens"] == [tokenizer.decode([t]) for t in ids]
    offsets = [0]
    for token in shaped["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert shaped["text_offset"] == offsets
