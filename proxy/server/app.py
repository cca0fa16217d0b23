"""The OpenAI-compatible HTTP server: FastAPI under uvicorn.

Local models run on the speculative engine (a scheduler thread batching every admitted request
into each target pass, bounded queue); other models are forwarded upstream. The port opens at once; ``/health`` answers 503 until the model is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from foretell.proxy.engine import GenerationRequest
from foretell.proxy.server.guard import GuardMiddleware, error_response
from foretell.proxy.server.logs import AccessLogMiddleware, note, note_result
from foretell.proxy.server.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs
from foretell.proxy.server.metrics import Metrics
from foretell.proxy.server.origins import OriginSpans
from foretell.proxy.server.playground import add_playground
from foretell.proxy.server.prompts import implied_chat_stops, request_prompt_ids
from foretell.proxy.server.redact import Redactor
from foretell.proxy.server.route_errors import route_error
from foretell.proxy.server.schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    describe_validation_error,
)
from foretell.proxy.server.upstream import Forwarder, RouteTable, prepare_body, relay
from foretell.proxy.server import echo as echo_mode
from foretell.proxy.server.remote_verify import RemoteVerifier
from foretell.proxy.engine.scheduler import DoneEvent, ErrorEvent, QueueFullError, TokensEvent

log = logging.getLogger("foretell.server")

# JSON nested deeper than this is refused (OpenAI bodies are shallow; deep nesting only costs).
MAX_JSON_DEPTH = 64
# Prompts tokenised at once (on worker threads): the body limit bounds each one's size, this
# bounds their number, so a burst of huge prompts cannot take every core before the queue.
MAX_PROMPTS_IN_PREPARATION = 2

FALLBACK_CHAT_TEMPLATE_NOTE = (
    "Models without a chat template get a plain transcript: 'System: ...', 'User: ...', "
    "'Assistant: ...' lines, ending with 'Assistant:'."
)


@dataclass
class ServerSettings:
    model: str | None = None
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_queue: int = 16
    max_body_bytes: int = 4 * 1024 * 1024
    max_prediction_chars: int = 1024 * 1024
    default_max_tokens: int = 512
    calibrate: bool = True
    recalibrate: bool = False  # measure again even when a cached calibration exists
    # The engine's batching: KV cache capacity in tokens, prompt tokens prefilled per step,
    # sequences in flight at once.
    kv_cache_tokens: int = 65536
    prefill_chunk: int = 256
    max_running: int = 16
    routes: RouteTable = field(default_factory=RouteTable)
    # The address served; the Host header must name it (or loopback, or an allowed host).
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # further Host header values; "*" allows any
    metrics_public: bool = False  # /metrics without the API key
    # The local model's precision (proxy/engine/precision.py): --dtype, --quantize, --fp32-head.
    dtype: str = "auto"
    quantize: str = "none"
    fp32_head: bool | None = None  # None: precision.default_fp32_head
    # Triton or the torch references for attention and verification (engine/kernel_choice.py).
    kernels: str | None = None  # None: FORETELL_KERNELS, else auto


class LocalModel:
    """The engine, its scheduler and its names, once loaded."""

    def __init__(self, loaded, scheduler, served_name: str):
        self.loaded, self.scheduler, self.name = loaded, scheduler, served_name
        self.precision = scheduler.engine.precision  # e.g. bfloat16+fp32-head, shown by /health
        self.kernels = scheduler.engine.kernels.describe()  # which run Triton, which fell back
        self.tokenizer = loaded.tokenizer
        # The engine's own limit (None: the model names none), checked here before queueing.
        self.context = scheduler.engine.max_positions
        # What ends a chat answer besides the request's stops: the plain transcript's next role
        # marker, or the chat template's end-of-turn tokens.
        self.chat_stops, self.chat_stop_token_ids = implied_chat_stops(self.tokenizer)


def _sse(payload) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def create_app(settings: ServerSettings, load_local=None) -> FastAPI:
    """Build the app. ``load_local(metrics)`` returns a ``LocalModel`` (run on a background
    thread)."""
    metrics = Metrics()
    forwarder = Forwarder()
    remote = RemoteVerifier(settings, forwarder)  # predictions verified by upstreams (remote_verify.py)
    state = {"local": None, "load_error": None}

    def load() -> None:
        try:
            local = (load_local or _default_loader(settings))(metrics)
            metrics.record_kernels(local.kernels)
            state["local"] = local  # /health turns 200 here, with everything recorded
        except Exception as error:  # reported by /health, the server stays up
            state["load_error"] = f"{type(error).__name__}: {error}"
        # torch, transformers and the model are hundreds of thousands of objects that live as
        # long as the server: out of the garbage collector's full passes, which would otherwise
        # walk them all (half a second, the GIL held, the event loop stalled) whenever a large
        # request's objects set one off.
        gc.freeze()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Load on a thread so the port opens at once and /health can answer 503 meanwhile.
        threading.Thread(target=load, name="foretell-load", daemon=True).start()
        remote.start()
        yield
        await remote.close()
        if state["local"] is not None:
            state["local"].scheduler.close()
        await forwarder.close()

    app = FastAPI(title="foretell", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    # ---- errors and auth ---------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        # Unknown paths and methods (404, 405) in the same envelope as every other error.
        return error_response(route_error(request.method, request.url.path, error.status_code,
                                          str(error.detail), error.headers,
                                          [getattr(route, "path", None) for route in app.routes]))

    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    app.add_middleware(AccessLogMiddleware)  # outside the guard: one foretell.access line per request
    add_playground(app)  # GET /: the playground page

    async def read_body(request: Request) -> dict:
        raw = await request.body()  # GuardMiddleware has bounded it to settings.max_body_bytes
        return await asyncio.to_thread(_parse_body, raw)  # megabytes of JSON: off the event loop

    # ---- plain endpoints -------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if state["local"] is not None:
            local = state["local"]
            return {"status": "ok", "model": local.name, "precision": local.precision,
                    "kernels": local.kernels}
        if state["load_error"]:
            return JSONResponse({"status": "error", "error": state["load_error"]}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        local = state["local"]
        metrics.queue_length.set(local.scheduler.queued if local else 0)
        metrics.running.set(local.scheduler.running if local else 0)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # vLLM's POST /tokenize and POST /detokenize for the local model (echo.py).
    echo_mode.add_token_routes(app, settings, lambda: state["local"], read_body, lambda: prompt_slots)

    @app.get("/v1/models")
    async def models():
        names = []
        if state["local"] is not None:
            names.append(state["local"].name)
        names += [m for m, r in settings.routes.models.items() if m not in names]
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "foretell"} for name in names]}

    # ---- generation ------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        return await generate(request, body, CompletionRequest, "/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        return await generate(request, body, ChatCompletionRequest, "/chat/completions")

    async def generate(request: Request, body: dict, schema, path: str):
        try:
            # A body of many small parts (100k messages) takes a second to validate.
            parsed = await asyncio.to_thread(schema.model_validate, body)
        except ValidationError as error:
            message, param = describe_validation_error(error)
            raise APIError(400, message, param=param) from None
        local = state["local"]
        local_names = {local.name} if local else set()
        if settings.served_model_name:
            local_names.add(settings.served_model_name)
        route = settings.routes.route_for(parsed.model, local_names)
        note(request.scope, model=parsed.model)
        if route is None:
            if local is None and not state["load_error"]:
                # The local model's name is known once it has loaded: it may be this one.
                raise APIError(503, "the model is still loading", type="server_error", code="model_loading",
                               headers={"Retry-After": "5"})
            raise APIError(404, f"model {parsed.model!r} does not exist", param="model",
                           code="model_not_found")
        note(request.scope, route="local" if route.local else route.upstream)
        if not route.local:
            upstream = settings.routes.upstreams[route.upstream]
            if remote.applies(upstream, parsed, body):
                return await remote.run(request, upstream, parsed, body, path == "/chat/completions",
                                        lambda: forward(request, upstream, path, body, parsed.stream))
            return await forward(request, upstream, path, body, parsed.stream)
        if local is None:
            raise APIError(503, "the model is still loading", type="server_error", code="model_loading",
                           headers={"Retry-After": "5"})
        try:
            if echo_mode.wanted(parsed):  # echo, prompt logprobs, token ids (echo.py)
                return await echo_mode.run(request, local, parsed, local_hooks)
            return await run_local(request, local, parsed, path)
        except QueueFullError:
            if route.fallback:
                note(request.scope, route=route.fallback)
                return await forward(request, settings.routes.upstreams[route.fallback], path, body,
                                     parsed.stream)
            raise APIError(429, "the server is busy: queue full", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None

    async def forward(request: Request, upstream, path: str, body: dict, stream: bool):
        request_id = request.scope.get("foretell.request_id", "-")
        body, notes = prepare_body(body, upstream)
        # Whatever an upstream answers is relayed without any route's key in it.
        redactor = Redactor(settings.routes.keys())
        try:
            response = await forwarder.open(upstream, path, body)
            return await relay(response, upstream, stream=stream, notes=notes, redactor=redactor,
                               request_id=request_id)
        except APIError as error:
            log.warning("%s: %s", request_id, redactor.text(error.message))
            raise

    prompt_slots = asyncio.Semaphore(MAX_PROMPTS_IN_PREPARATION)

    async def run_local(request: Request, local: LocalModel, parsed, path: str):
        is_chat = path == "/chat/completions"
        # Templates and tokenisation take seconds on a large prompt: off the event loop.
        async with prompt_slots:
            prompt_ids = await asyncio.to_thread(request_prompt_ids, local.tokenizer, parsed, is_chat,
                                                 local.context)
        requested = parsed.max_tokens_or(settings.default_max_tokens if is_chat else 16)
        if local.context is not None and requested > local.context - len(prompt_ids):
            raise APIError(400, f"max_tokens {requested} plus the prompt's {len(prompt_ids)} tokens "
                           f"exceed the context of {local.context}", param="max_tokens",
                           code="context_length_exceeded")
        prediction = parsed.prediction.text() if parsed.prediction else None
        if prediction is not None and len(prediction) > settings.max_prediction_chars:
            raise APIError(413, f"prediction over {settings.max_prediction_chars} characters",
                           param="prediction", code="prediction_too_large")
        if parsed.stream and parsed.n > 1:
            raise APIError(400, "n > 1 is not supported with stream", param="n")
        speculation = parsed.speculation
        gen_request = GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=requested, prediction=prediction,
            prompt_lookup=speculation.prompt_lookup if speculation else None,
            stop=parsed.stop_strings() + (local.chat_stops if is_chat else ()),
            stop_token_ids=local.chat_stop_token_ids if is_chat else (),
            max_draft=(speculation and speculation.max_draft) or GenerationRequest.max_draft,
            temperature=parsed.temperature or 0.0, top_p=parsed.top_p or 1.0, top_k=parsed.top_k or None,
            seed=parsed.seed, logprobs=parsed.logprob_alternatives(),
        )
        ids = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        # n choices are sibling sequences sharing the prompt's blocks; a seeded request's further
        # choices take the next seeds (modulo 2**64), so they differ yet replay.
        choices = [gen_request] + [
            dataclasses.replace(gen_request, seed=None if gen_request.seed is None
                                else (gen_request.seed + i) % 2**64)
            for i in range(1, parsed.n)]
        job = local.scheduler.submit(choices)  # QueueFullError: answered 429 by the caller
        started = time.perf_counter()
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            origins = (OriginSpans(local.tokenizer, gen_request.stop)
                       if speculation and speculation.report_origins else None)
            return StreamingResponse(
                stream_events(request, local, job, ids, created, is_chat, include_usage, started, origins),
                media_type="text/event-stream")
        results = await collect(request, local, job, started)
        return completion_body(local, results, ids, created, is_chat)

    async def wait_event(request: Request, job):
        """Next engine event; cancels the job when the client has gone away (checked at most
        every 0.25 s, also while events keep coming)."""
        while True:
            if time.monotonic() - job.checked_at > 0.25:
                job.checked_at = time.monotonic()
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                continue

    async def collect(request: Request, local: LocalModel, job, started: float):
        """Every choice's result, in choice order; None when the client went away."""
        first, results = None, [None] * len(job.requests)
        try:
            while any(r is None for r in results):
                event = await wait_event(request, job)
                if isinstance(event, TokensEvent):
                    first = first or time.perf_counter()
                elif isinstance(event, ErrorEvent):
                    raise _generation_error(event.error)
                else:
                    observe(local, event.result, started, first)
                    note_result(request.scope, event.result)
                    results[event.choice] = event.result
            return results
        except ClientGone:
            return None

    def observe(local: LocalModel, result, started: float, first: float | None) -> None:
        now = time.perf_counter()
        if first is not None:
            metrics.time_to_first_token.labels(local.name).observe(first - started)
            if result.stats.completion_tokens > 1:
                metrics.inter_token_latency.labels(local.name).observe(
                    (now - first) / (result.stats.completion_tokens - 1))
        metrics.e2e_latency.labels(local.name).observe(now - started)

    async def stream_events(request, local: LocalModel, job, ids, created, is_chat, include_usage, started,
                            origins: OriginSpans | None = None):
        kind = "chat.completion.chunk" if is_chat else "text_completion"

        def chunk(choice: dict, usage=None, extra=None) -> bytes:
            payload = {"id": ids, "object": kind, "created": created, "model": local.name,
                       "choices": [choice] if choice is not None else []}
            if usage is not None:
                payload["usage"] = usage
            if extra:
                payload.update(extra)
            return _sse(payload)

        texts = TokenTexts(local.tokenizer)
        offset = 0  # completions' text_offset runs on across chunks

        def choice(text: str | None, finish_reason=None, role=False, logprobs=None) -> dict:
            nonlocal offset
            if is_chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {"content": text} if text is not None else {})
                shaped = chat_logprobs(logprobs, texts) if logprobs else None
                return {"index": 0, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason}
            shaped = None
            if logprobs:
                shaped = completion_logprobs(logprobs, texts, offset)
                offset = shaped["text_offset"][-1] + len(shaped["tokens"][-1])
            return {"index": 0, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}

        first = None
        try:
            if is_chat:
                yield chunk(choice(None, role=True))
            while True:
                try:
                    event = await wait_event(request, job)
                except ClientGone:
                    return
                if isinstance(event, TokensEvent):
                    first = first or time.perf_counter()
                    if origins is not None:  # the report_origins extension
                        origins.add(event.token_ids, event.origins)
                    if event.text or event.logprobs:
                        extra = {"foretell": origins.report(event.text)} if origins is not None else None
                        yield chunk(choice(event.text, logprobs=event.logprobs), extra=extra)
                    continue
                if isinstance(event, ErrorEvent):
                    yield _sse(_generation_error(event.error).body())
                    yield b"data: [DONE]\n\n"
                    return
                result = event.result
                observe(local, result, started, first)
                note_result(request.scope, result)
                yield chunk(choice(None if is_chat else "", finish_reason=_finish(result)))
                if include_usage:
                    yield chunk(None, usage=usage_body(result), extra={"speculation": speculation_body(result)})
                yield b"data: [DONE]\n\n"
                return
        finally:
            job.cancel()  # no-op when finished; stops the engine if the client went away

    def completion_body(local: LocalModel, results, ids, created, is_chat) -> dict | Response:
        if results is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choices = []
        texts = TokenTexts(local.tokenizer)
        for index, result in enumerate(results):
            logprobs = None
            if result.logprobs is not None:
                shape = chat_logprobs if is_chat else completion_logprobs
                logprobs = shape(result.logprobs, texts)
            if is_chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": result.text},
                                "logprobs": logprobs, "finish_reason": _finish(result)})
            else:
                choices.append({"index": index, "text": result.text, "logprobs": logprobs,
                                "finish_reason": _finish(result)})
        usage = usage_body(results[0])
        usage["completion_tokens"] = sum(r.stats.completion_tokens for r in results)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": ids, "object": "chat.completion" if is_chat else "text_completion",
                "created": created, "model": local.name, "choices": choices, "usage": usage,
                "speculation": speculation_body(results[0])}

    local_hooks = echo_mode.LocalHooks(
        settings=settings, prompt_slots=prompt_slots, collect=collect, wait_event=wait_event, observe=observe,
        usage_body=usage_body, speculation_body=speculation_body, finish=_finish,
        generation_error=_generation_error, client_gone=ClientGone)
    return app


class ClientGone(Exception):
    pass


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _parse_body(raw: bytes) -> dict:
    """A request body as a JSON object, or APIError 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except ValueError as error:  # not JSON, NaN / Infinity, or an integer of > 4300 digits
        raise APIError(400, f"request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if _json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json")
    return body


def _json_depth(value) -> int:
    """How deeply a parsed JSON value nests (iteratively: no recursion limit to hit)."""
    deepest, todo = 1, [(value, 1)]
    while todo:
        container, depth = todo.pop()
        deepest = max(deepest, depth)
        items = container.values() if isinstance(container, dict) else container
        todo += [(item, depth + 1) for item in items if isinstance(item, (dict, list))]
    return deepest


def _finish(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _generation_error(error: Exception) -> APIError:
    """A failed generation in the envelope: a request the engine refused is the caller's fault."""
    if isinstance(error, ValueError):
        return APIError(400, str(error), code="invalid_request")
    return APIError(500, f"generation failed: {error}", type="server_error")


def usage_body(result) -> dict:
    stats = result.stats
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.rejected_prediction_tokens,
            "reasoning_tokens": 0,
        },
    }


def speculation_body(result) -> dict:
    """foretell's per-request speculation report (an extension field of the response)."""
    # The seed a sampled request ran with (its own, or a fresh one to replay it with).
    return {**result.stats.speculation_report(), "seed": result.seed}


def _default_loader(settings: ServerSettings):
    def load(metrics: Metrics) -> LocalModel:
        from foretell.proxy.engine import SpeculativeEngine
        from foretell.proxy.engine.calibration_cache import calibrate_with_cache
        from foretell.proxy.engine.model_loader import load_model
        from foretell.proxy.engine.scheduler import Scheduler

        loaded = load_model(settings.model, dtype=settings.dtype, quantize=settings.quantize,
                            fp32_head=settings.fp32_head)
        engine = SpeculativeEngine(loaded.model, loaded.tokenizer, kv_cache_tokens=settings.kv_cache_tokens,
                                   prefill_chunk=settings.prefill_chunk, max_sequences=settings.max_running,
                                   fp32_head=settings.fp32_head, kernels=settings.kernels)
        logging.getLogger("foretell.server").info("engine precision: %s; kernels: %s", engine.precision,
                                                  ", ".join(engine.kernels.triton) or "torch references")
        if settings.calibrate:  # from the calibration cache when this machine measured it before
            calibrate_with_cache(engine, loaded.source, recalibrate=settings.recalibrate)
        name = settings.served_model_name or loaded.name

        def record(result) -> None:
            metrics.record_generation(name, result.stats, result.finish_reason)
            metrics.record_cache(engine.cache)

        scheduler = Scheduler(engine, settings.max_queue, settings.max_running, on_result=record)
        return LocalModel(loaded, scheduler, name)

    return load
