"""The local model as the server holds it: the engine behind its scheduler, its names, its
tokenizer and limits; and the default loader, which builds one from the server's settings."""

from __future__ import annotations

import logging

from foretell.proxy.server.metrics import Metrics
from foretell.proxy.server.prompts import implied_chat_stops, template_source
from foretell.proxy.server.settings import ServerSettings

log = logging.getLogger("foretell.server")


class LocalModel:
    """The engine, its scheduler and its names, once loaded."""

    def __init__(self, loaded, scheduler, served_name: str):
        self.loaded, self.scheduler, self.name = loaded, scheduler, served_name
        self.precision = scheduler.engine.precision  # e.g. bfloat16+fp32-head, shown by /health
        self.kernels = scheduler.engine.kernels.describe()  # which run Triton, which fell back
        self.batch_invariant = scheduler.engine.batch_invariant  # one text per request, whatever runs
        self.native_loops = scheduler.engine.native_loops  # e.g. ["attention", "int8 rows", "rms norm"]
        drafter = scheduler.engine.draft_model
        self.draft_model = drafter.name if drafter is not None else None  # e.g. self:int8, shown by /health
        from foretell.proxy.engine.kernel_timing import describe_cpu

        self.cpu = describe_cpu()  # the CPU's model and the features its kernels were chosen for
        self.tokenizer = loaded.tokenizer
        # The engine's own limit (None: the model names none), checked here before queueing.
        self.context = scheduler.engine.max_positions
        # What ends a chat answer besides the request's stops: the plain transcript's next role
        # marker, or the chat template's end-of-turn tokens.
        self.chat_stops, self.chat_stop_token_ids = implied_chat_stops(self.tokenizer)
        from foretell.proxy.server.tool_calls.format import call_format

        self.call_format = call_format(template_source(self.tokenizer))  # how its answers call tools
        from foretell.proxy.prediction_tokens import PredictionTokenizer

        # Predictions as token ids, a long one tokenised in a child process (GIL-free here).
        self.prediction_tokens = PredictionTokenizer(self.tokenizer)

    def grammar(self, grammar: str):
        """A request's output grammar (``engine/grammar.py``; llguidance's text: ``json_grammar``,
        ``tool_calls.format.call_grammar``), which ends at the model's EOS (in a chat too: the end
        of turn would not end a completion, and one table serves both). ValueError for a grammar
        the grammar engine cannot take. Call it off the event loop: it compiles the grammar."""
        from foretell.proxy.engine.grammar import Grammar

        vocab_size = self.scheduler.engine.model.config.vocab_size
        return Grammar(self.grammar_tokenizer(), grammar, vocab_size)

    def grammar_tokenizer(self):
        """llguidance's table of the vocabulary, built once: seconds at 262k tokens, holding the
        GIL (every stream waits meanwhile), so the loader builds it before the model is ready."""
        from foretell.proxy.engine.grammar import grammar_tokenizer

        engine = self.scheduler.engine
        return grammar_tokenizer(self.tokenizer, engine.model.config.vocab_size, engine.eos_token_ids)


def default_loader(settings: ServerSettings):
    """``load(metrics) -> LocalModel`` for ``settings.model`` (the embedded model when None)."""

    def load(metrics: Metrics) -> LocalModel:
        from foretell.proxy.engine import SpeculativeEngine
        from foretell.proxy.engine.calibration_cache import calibrate_with_cache
        from foretell.proxy.engine.model_loader import load_model
        from foretell.proxy.engine.scheduler import Scheduler

        loaded = load_model(settings.model, dtype=settings.dtype, quantize=settings.quantize,
                            fp32_head=settings.fp32_head)
        draft = None
        if settings.draft_model:
            from foretell.proxy.engine.draft_model import load_draft_model

            draft = load_draft_model(settings.draft_model, loaded)
        draft_cache = None
        if settings.draft_cache_scope != "off":
            from foretell.proxy.engine.draft_cache import DraftCache

            try:
                draft_cache = DraftCache(max_tokens=settings.draft_cache_tokens)
            except ImportError as error:  # a hand-made install without the optional package
                log.warning("draft cache off: %s", error)
        engine = SpeculativeEngine(loaded.model, loaded.tokenizer, kv_cache_tokens=settings.kv_cache_tokens,
                                   prefill_chunk=settings.prefill_chunk, max_sequences=settings.max_running,
                                   fp32_head=settings.fp32_head, kernels=settings.kernels,
                                   draft_cache=draft_cache, draft_model=draft and draft.model,
                                   draft_model_name=settings.draft_model or "draft")
        from foretell.proxy.engine.kernel_timing import cpu_features

        log.info("engine precision: %s (batch invariant: %s); kernels: %s; native CPU loops: %s; decoder layers: %s; "
                 "CPU features: %s", engine.precision, "yes" if engine.batch_invariant else "no",
                 ", ".join(engine.kernels.triton) or "torch references", ", ".join(engine.native_loops) or "none",
                 "one function each" if engine.lean_layers else "transformers'", ", ".join(cpu_features()) or "-")
        if settings.calibrate:  # from the calibration cache when this machine measured it before
            calibrate_with_cache(engine, loaded.source, recalibrate=settings.recalibrate)
            if engine.draft_model is not None:
                cost = engine.draft_model.calibrate()
                log.info("draft model %s: pass cost %.0f ms + %.1f ms per row", settings.draft_model,
                         1000 * cost.fixed, 1000 * cost.per_position)
        name = settings.served_model_name or loaded.name

        def record(result) -> None:
            metrics.record_generation(name, result.stats, result.finish_reason)
            metrics.record_cache(engine.cache, engine.draft_cache)

        scheduler = Scheduler(engine, settings.max_queue, settings.max_running, on_result=record)
        local = LocalModel(loaded, scheduler, name)
        if settings.grammar_warmup:
            try:
                local.grammar_tokenizer()  # the grammar's table: now, not in the middle of serving
            except ValueError as error:  # a slow (Python) tokenizer: grammar requests answer 400
                log.warning("structured output and required tool calls unavailable: %s", error)
        return local

    return load
