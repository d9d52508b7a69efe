"""`moelab bench agent`: a coding agent's session replayed through the Messages API
(engine/bench/agent_session.py), against a running engine (`--url`) or one it starts with the engine
flags given after `--`. Each turn's line goes to stderr as it ends, then the session's; `--json`
prints the whole result on stdout."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import httpx

from ..config.args import build_parser
from ..process import launch
from .agent_session import TURN_HEADER, AgentSession, MessagesClient, SessionShape, turn_row

READY_TIMEOUT_S = 3600.0  # a large checkpoint's first start writes its expert bank
REQUEST_TIMEOUT_S = 3600.0
WARMUP = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hello."}], "ignore_eos": True}


def token_range(text: str) -> tuple[int, int]:
    """`MIN-MAX` (or one number N, for N-N) tokens."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a range; write MIN-MAX, e.g. 50-300"
        ) from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: the range needs 1 <= MIN <= MAX")
    return bounds


def add_agent_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "agent",
        help="replay a coding agent's session through the Messages API: time to first token per "
        "turn, decode tok/s, prefix-cache hits, the session's time",
    )
    p.add_argument(
        "--url",
        default=None,
        help="a running engine, e.g. http://127.0.0.1:8000; default: start one with the "
        "`moelab serve` flags given after --",
    )
    p.add_argument("--api-key", default=None, help="the running engine's --api-key")
    p.add_argument("--turns", type=int, default=20, help="requests in the session")
    p.add_argument(
        "--system-tokens",
        type=int,
        default=12_000,
        help="the system prompt's tokens, its tool definitions included",
    )
    p.add_argument(
        "--tool-result-tokens",
        type=token_range,
        default=(500, 4_000),
        help="MIN-MAX: the tool result each turn after the first adds",
    )
    p.add_argument(
        "--reply-tokens",
        type=token_range,
        default=(50, 300),
        help="MIN-MAX: the tokens each turn generates",
    )
    p.add_argument("--seed", type=int, default=0, help="draws the session's sizes and text")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument(
        "engine_flags",
        nargs=argparse.REMAINDER,
        metavar="-- SERVE_FLAGS",
        help="where no --url is given: the `moelab serve` flags of the engine to start",
    )
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    shape = SessionShape(
        turns=args.turns,
        system_tokens=args.system_tokens,
        result_tokens=args.tool_result_tokens,
        reply_tokens=args.reply_tokens,
        seed=args.seed,
    )
    flags = args.engine_flags[1:] if args.engine_flags[:1] == ["--"] else args.engine_flags
    if args.url and flags:
        raise ValueError("give either --url or the flags of an engine to start after --, not both")
    if args.url:
        result = bench(args.url.rstrip("/"), shape, args.api_key)
    else:
        if not flags:
            raise ValueError(
                "give --url of a running engine, or the flags of one to start after --, e.g. "
                "moelab bench agent -- --model-path DIR"
            )
        build_parser().parse_args(flags)  # a wrong flag is refused before anything starts
        result = _with_engine(flags, shape)
    if args.json:
        print(json.dumps(result))
    return 0


def _with_engine(flags: list[str], shape: SessionShape) -> dict:
    """Start an engine with `flags` on a free port of this machine, bench it, stop it."""
    workdir = Path(tempfile.mkdtemp(prefix="moelab-bench-agent-"))
    listener = launch.listen_on("127.0.0.1", [0])
    assert listener is not None  # port 0: the system picks a free one
    port = listener.getsockname()[1]
    with listener:
        engine = launch.start_engine(
            [*flags, "--host", "127.0.0.1", "--port", str(port)],
            workdir / "engine.log",
            listener=listener,
        )
    _say(f"moelab bench agent: starting an engine (log: {engine.log_path})")
    try:
        try:
            launch.wait_ready(engine, READY_TIMEOUT_S)
        except launch.EngineFailed as err:
            raise ValueError(f"{err}\n{err.log_tail}") from None
        api_key = launch.flag_value(flags, "--api-key")
        return {**bench(engine.base_url, shape, api_key), "engine_flags": flags}
    finally:
        launch.stop_engine(engine)


def bench(base_url: str, shape: SessionShape, api_key: str | None = None) -> dict:
    """Replay one session of `shape` against the engine at `base_url`: its result as JSON."""
    health = launch.get_json(base_url + "/health", timeout_s=10.0, api_key=api_key)
    if not health or health.get("status") != "ok":
        raise ValueError(f"no ready engine at {base_url} (/health: {health})")
    context = int(health["max_model_len"])
    headers = {"x-api-key": api_key} if api_key else {}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, headers=headers) as http:
        client = MessagesClient(http, base_url)
        session = AgentSession.sized(shape, client)
        if session.context_tokens > context:
            raise ValueError(
                f"this session needs about {session.context_tokens} tokens of context, and the "
                f"engine serves {context}; start it with a larger --kv-reserve-tokens (or "
                "--max-context), or shorten the session (--turns, --tool-result-tokens, "
                "--system-tokens)"
            )
        client.stream(WARMUP, 0)  # the first requests compile what the session's then use
        _say(TURN_HEADER)
        result = session.run(client, on_turn=lambda turn: _say(turn_row(turn)))
    _say(result.summary())
    return {**result.to_json(), "url": base_url, "model": health.get("model"),
            "max_model_len": context}  # fmt: skip


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
