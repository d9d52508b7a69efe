"""Completion requests to one engine over HTTP, streamed and timed as the client sees them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ..engine.bench.agent_session import MessagesClient, refusal_text


class WorkloadError(RuntimeError):
    """The engine refused or broke off a workload request; the message says which and why."""


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """One streamed request as the client saw it."""

    prompt_tokens: int
    completion_tokens: int
    sent: float
    first_token: float
    last_token: float

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.sent

    def decode_tok_s(self, prefill_tok_s: float) -> float | None:
        """Tokens after the first over the time after the prompt was read.

        The prompt's time is the measured TTFT, or what the long prompt's rate predicts for this
        prompt when that is shorter: a busy engine thread can hold back the first chunks and
        send them in one burst, and then the client's TTFT and first-to-last span mislead while
        the time of the last token does not.
        """
        if self.completion_tokens < 2:
            return None
        prompt_s = min(self.ttft_s, self.prompt_tokens / prefill_tok_s)
        decode_s = self.last_token - self.sent - prompt_s
        return (self.completion_tokens - 1) / decode_s if decode_s > 0 else None

    @property
    def wall_s(self) -> float:
        """From sending the request to its last token."""
        return self.last_token - self.sent


class EngineClient:
    """Completion requests to one engine over HTTP, streamed and timed.

    One connection pool serves every request of a trial (threads included), so a request's
    time is the engine's, not that of building a client and connecting. `clock` (seconds) times
    the requests and the workload; tests give a clock of their own with a `transport` that
    answers in-process (httpx.MockTransport), so that the time a fake engine takes is theirs.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        api_key: str | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url
        self.clock = clock
        self._http = httpx.Client(
            timeout=timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            transport=transport,
        )

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def stream(self, prompt: str, max_tokens: int, seed: int) -> StreamTiming:
        """Send one streamed completion; its timing and the engine's usage."""
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.7,
            "seed": seed,
        }
        first = last = None
        usage: dict[str, Any] | None = None
        sent = self.clock()
        with self._http.stream("POST", self.base_url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise WorkloadError(refusal_text(response))
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise WorkloadError(f"the engine broke off a request: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):
                    now = self.clock()
                    first = now if first is None else first
                    last = now
        if usage is None or first is None or last is None:
            raise WorkloadError("the engine's stream ended without tokens or usage")
        return StreamTiming(
            prompt_tokens=int(usage["prompt_tokens"]),
            completion_tokens=int(usage["completion_tokens"]),
            sent=sent,
            first_token=first,
            last_token=last,
        )

    def messages(self) -> MessagesClient:
        """The engine's Messages API over this client's connections and clock."""
        return MessagesClient(self._http, self.base_url, clock=self.clock)

    def complete(self, prompt: str, max_tokens: int) -> tuple[int, dict[str, Any]]:
        """One plain completion: (HTTP status, body)."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        response = self._http.post(self.base_url + "/v1/completions", json=body)
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {"error": {"message": response.text[:500]}}
