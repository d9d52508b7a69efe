"""One API request's run on the engine: its tokens as text pieces, and the counts its usage gives.

The text comes in whole characters (tokenizer.IncrementalDecoder) and ends before the first of
the request's stop strings. A chat request with a reasoning budget is watched token by token
(reasoning.ReasoningBudget): once the budget is spent inside the reply's <think> block, its engine
request is cancelled and a continuation takes its place, whose prompt is the prompt, the reply so
far and the closing tag (reasoning.CLOSING; in gpt-oss's format, harmony.CLOSING: the analysis
message's end and the final one's header). The prefix cache holds the pages of the first two
already, so the continuation computes little more than the tag before it goes on with the
answer, for what is left of max_tokens. The tag's text is part of the reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..model.tokenizer import IncrementalDecoder
from ..runtime.sampling import SamplingParams, TokenLogprobs
from ..runtime.scheduler import ContextTooLong
from ..runtime.worker import EngineWorker, QueueFull
from ..runtime.worker import Request as EngineRequest
from . import harmony
from .openai_api import ApiError, ParsedRequest, StopMatcher
from .reasoning import CLOSING, ReasoningBudget, opened_by_prompt


class Generation:
    """A request's engine requests (the first, and a reasoning budget's continuation) and the
    reply's tokens read from them."""

    def __init__(
        self,
        worker: EngineWorker,
        engine,
        parsed: ParsedRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        limit: int,
        boundaries: tuple[int, ...] = (),
    ) -> None:
        """`boundaries`: the prompt's token counts where its messages end (Engine.add)."""
        self.worker = worker
        self.engine = engine
        self.parsed = parsed
        self.prompt_ids = prompt_ids
        self.max_tokens = params.max_tokens
        self.limit = limit  # requests in flight past which the worker refuses one
        self.boundaries = boundaries
        self.first = EngineRequest(prompt_ids, params, asyncio.get_running_loop(), boundaries)
        self.req = self.first  # the engine request read now
        self.before = 0  # reply tokens before `req`'s own (a continuation's prompt holds them)
        self.stop_matched: str | None = None  # the stop string the text ended before

    def submit(self) -> None:
        """Queue the first engine request; 429 where too many are in flight."""
        _submit(self.worker, self.first, self.limit)

    def cancel(self) -> None:
        """Stop generating (the client went away, or the text ended at a stop string)."""
        self.worker.cancel(self.req)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def cached_tokens(self) -> int | None:
        """The prompt's tokens the prefix cache held (None: the request never ran)."""
        return self.first.seq.cached_tokens if self.first.seq is not None else None

    def completion_tokens(self, given: int) -> int:
        """The tokens generated for the reply, a closing tag the server wrote included (the
        engine's count: it may have run past a stop string); `given`, the tokens handed out,
        where the engine request never ran."""
        seq = self.req.seq
        return self.before + len(seq.output_ids) if seq is not None else given

    async def pieces(self) -> AsyncIterator[tuple[str, str | None, TokenLogprobs | None]]:
        """(text piece, finish reason, the token's log probabilities or None) as tokens arrive;
        stop strings applied, a spent reasoning budget's closing tag written."""
        tokenizer = self.engine.tokenizer
        parsed = self.parsed
        # a harmony reply's special tokens are its structure: the text keeps them
        decoder = IncrementalDecoder(tokenizer, parsed.harmony is None) if tokenizer else None
        stops = StopMatcher(parsed.stop)
        budget = None
        if parsed.reasoning_budget is not None and tokenizer is not None:
            if parsed.harmony is not None:
                reading = harmony.HarmonyStream(calls=False)
                reading.feed(parsed.reply_prefix)
                budget = ReasoningBudget(parsed.reasoning_budget, reading=reading)
            else:
                opened = opened_by_prompt(parsed.prompt_text or "")
                budget = ReasoningBudget(parsed.reasoning_budget, opened)
        reply: list[int] = []  # the reply's tokens so far, a written tag's included
        while True:
            token, finish, logprobs = await self.req.events.get()
            if isinstance(finish, ContextTooLong):
                raise ApiError(400, str(finish), code="context_length_exceeded")
            if token < 0:
                raise ApiError(
                    500,
                    f"generation failed: {finish or 'engine error'}",
                    type_="server_error",
                    code="engine_error",
                )
            reply.append(token)
            piece = decoder.push(token) if decoder else ""
            if budget is not None and finish is None and budget.feed(piece):
                budget = None  # once: the reply's next <think> is text
                closing = self._close_reasoning(reply)
                piece += "".join(decoder.push(t) for t in closing) if decoder else ""
            if decoder and finish is not None:
                piece += decoder.flush()
            text, stopped = stops.feed(piece)
            if stopped:
                self.stop_matched = stops.matched
                self.cancel()
                yield text, "stop", logprobs
                return
            if finish is not None:
                yield text + stops.flush(), finish, logprobs
                return
            yield text, None, logprobs

    def _close_reasoning(self, reply: list[int]) -> list[int]:
        """End the reply's reasoning: the closing tag's tokens, and a continuation after them in
        place of the engine request; none where max_tokens leaves no room for an answer (the
        reply then runs out inside its reasoning)."""
        tag = harmony.CLOSING if self.parsed.harmony is not None else CLOSING
        closing = self.engine.tokenizer.encode(tag)
        room = self.max_tokens - len(reply) - len(closing)
        if room < 1:
            return []
        self.cancel()
        self.before = len(reply) + len(closing)
        reply += closing
        params = self.parsed.sampling(room)
        self.req = EngineRequest(
            self.prompt_ids + reply, params, asyncio.get_running_loop(), self.boundaries
        )
        # it takes the place of the request just cancelled, which may still count as in flight
        _submit(self.worker, self.req, self.limit + 1)
        return closing


def _submit(worker: EngineWorker, req: EngineRequest, limit: int) -> None:
    try:
        worker.submit(req, limit)
    except QueueFull as err:
        raise ApiError(
            429,
            f"too many requests: {err}; retry shortly",
            type_="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
