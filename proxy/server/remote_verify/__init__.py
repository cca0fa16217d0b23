"""Remote verification: predicted outputs for any vLLM-style upstream, through prompt logprobs.

vLLM (and SGLang) drop OpenAI's ``prediction``, but their ``/v1/completions`` can verify a whole
draft in one request: with ``echo: true, logprobs: 1, max_tokens: 1`` the answer holds, for every
prompt token, the token itself and the model's best alternative at that position. Send
``prompt + output so far + draft`` as the prompt and the best token at each draft position is
exactly what greedy decoding would choose there: the longest prefix of the draft that agrees is
accepted, the best token at the first disagreement is the *recovered* token, and the one token
generated after a fully accepted draft is the *bonus*. One prefill verifies hundreds of tokens.

A request's speculation is the engine's own (``engine/speculation.py``: the draft sources and
their estimates, the output with its stops and ``max_tokens``, the statistics, the prediction's
usage), driven through its public methods; which source drafts and how much is the engine's
choice (``draft_length.choose_drafts`` over every source's offer) against this upstream's
costs. A finished request's figures go to its access line and to the metrics under the
upstream's name, as a local one's do. A session runs for a greedy request (explicit
``temperature: 0``) with a prediction or with ``speculation.prompt_lookup``, on an upstream whose
``verify_predictions`` is on:

- **verify**: one echo request over ``prompt + output + draft`` (the prediction, or prompt
  lookup's runs of at least ``LOOKUP_MIN_DRAFT`` tokens); what agreed is accepted with the
  recovered or bonus token (``Speculation.accept``);
- **plain**: where no draft is available (after an edit's seam), a plain greedy stream continues
  the output (a round with no draft: ``accept(0, tokens)``) and is closed as soon as a draft is
  worth verifying again (the output rejoins the prediction, or prompt lookup finds a run);
- **when**: the request's first prediction draft is always verified (the prediction is presumed
  right where the output starts, so one echo request at most is risked); after that a verify is
  sent only while its expected yield beats plain decoding for the time it costs; both costs are
  measured per upstream (an echo request's time by its prompt tokens, a plain token's time in
  plain streams), so a GPU upstream, where prefill is cheap, keeps verifying, and a slow-prefill
  upstream decodes plainly until a copy has proven itself;
- text goes to the client as it is confirmed, never past a stop string (``Output.release``).

**Token alignment.** *Token ids* (exact): when the route names a local ``tokenizer`` matching the
upstream's model and the upstream answers vLLM's ``return_tokens_as_token_ids``, every request
sends its prompt as token ids (OpenAI's legacy API takes them; vLLM, SGLang and foretell do):
the prompt's ids, then the very ids the upstream chose, then the draft's ids; the echo's ids
must be exactly those sent. Nothing is re-tokenised, so the context is the upstream's own
decoding whatever token sequence the model wrote. An upstream that refuses its first prompt of
token ids (a 4xx) gets text prompts from then on: the local tokenizer must then re-tokenise
``prompt + output`` into exactly the prompt's ids plus the ids chosen, and where it does not
(the model wrote a token sequence that is not how its tokenizer splits the same text; rare for
real models, but a seam merging two tokens does it) the rest of the request continues as plain
greedy decoding from the last point known to be exact, replaying what was already sent. *Text*
(best effort): without a tokenizer or token ids, the echo's token strings are laid over the
text sent (their ``text_offset`` must agree, up to one constant shift such as a ``<bos>`` the
upstream counts) and compared as strings, so a rare re-tokenisation difference can go unseen.

**Failures.** A malformed echo answer, a 5xx or a dropped connection never produce text: the
request continues as plain decoding from the last exact point (the upstream's own greedy text);
if that fails too, the client gets the error (a 502, or an error event in a stream).

Sampling, ``n > 1``, logprobs, echo and any other field that changes decoding are forwarded as
before; ``prediction`` goes natively to upstreams marked ``supports_prediction``.

The parts, each with one job:

- ``echo_protocol.py``: the bodies sent and the checks on the answers (pure functions);
- ``upstream_state.py``: what is known of each upstream (tokenizer, token ids, costs), its
  start-up probe, and JSON requests with failures as ``RemoteFailure``;
- ``alignment.py``: one request's token alignment with the upstream and its last exact point;
- ``draft_choice.py``: which source's draft, how long, and how it is spelled for the upstream;
- ``session.py``: one request's rounds (verify a draft, accept, or decode plainly);
- ``plain_stream.py``: plain greedy decoding between verifies;
- ``verifier.py``: which requests it takes, and the HTTP around a session.
"""

from foretell.proxy.server.remote_verify.echo_protocol import EchoAnswer, RemoteFailure, parse_echo
from foretell.proxy.server.remote_verify.session import RemoteRequest, Session
from foretell.proxy.server.remote_verify.upstream_state import UpstreamState, load_tokenizer
from foretell.proxy.server.remote_verify.verifier import RemoteVerifier

__all__ = ["EchoAnswer", "RemoteFailure", "RemoteRequest", "RemoteVerifier", "Session", "UpstreamState",
           "load_tokenizer", "parse_echo"]
