"""The checkpoint's tokenizer (tokenizers library) and chat template (jinja2), as HF has them."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .spec import CheckpointError


class ChatTemplateError(ValueError):
    """The chat template refused the messages (it called raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False
):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encodes, decodes and renders chats for one checkpoint."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{path} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the tokenizers library raises its own exception type
            raise CheckpointError(f"{tokenizer_file} cannot be loaded: {err}") from None
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        self.special: dict[str, str | None] = {
            key: _token_text(config.get(key))
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        self._template = None
        self.chat_template_source: str | None = template or None
        if template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(template)
            except jinja2.TemplateError as err:
                raise CheckpointError(f"the chat template does not compile: {err}") from None
        eos: set[int] = set()
        for source in (generation.get("eos_token_id"), model_config.get("eos_token_id")):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list):
                eos.update(int(i) for i in source)
        if self.special["eos_token"]:
            token_id = self._tok.token_to_id(self.special["eos_token"])
            if token_id is not None:
                eos.add(token_id)
        self.eos_token_ids = frozenset(eos)
        # the most characters one token stands for (byte-level vocabularies write a byte a
        # character, and no character of a text is less than a byte)
        self.max_token_chars = max(
            (len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def min_tokens(self, text: str) -> int:
        """A floor under len(encode(text)) found without encoding: every token stands for at
        most max_token_chars characters, of a text that normalizing may shorten, though not to
        less than half (a margin: no normalizer of a released model does so)."""
        return len(text) // (2 * self.max_token_chars)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_marked(
        self, text: str, marks: tuple[int, ...], add_special_tokens: bool = False
    ) -> tuple[list[int], tuple[int, ...]]:
        """`encode(text)`, and for each character offset in `marks` (ascending) how many of the
        tokens lie wholly before it: where the token ids part at that place of the text (a token
        across it is left after)."""
        encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        ends = [end for _, end in encoding.offsets]
        counts, n = [], 0
        for mark in marks:
            while n < len(ends) and ends[n] <= mark:
                n += 1
            counts.append(n)
        return encoding.ids, tuple(counts)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """One token's text as it decodes alone (a special token's own text too); a piece of a
        multi-byte character decodes to U+FFFD: `token_bytes` has its bytes."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """One token's bytes (OpenAI's logprobs `bytes`): a byte-level vocabulary's pieces
        mapped back to their bytes, a byte-fallback piece (<0xAB>) as its byte, else the UTF-8
        of the token's text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self._added_ids:
            return list(self.token_text(token_id).encode())
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return [_BYTE_OF_CHAR[c] for c in piece]
        if match := _BYTE_PIECE.fullmatch(piece):
            return [int(match.group(1), 16)]
        return list(self.token_text(token_id).encode())

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps bytes to characters as GPT-2 did (ByteLevel, alone or in a
        sequence of decoders)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        parts = [decoder]
        if decoder.get("type") == "Sequence":
            parts = decoder.get("decoders") or []
        return any(part.get("type") == "ByteLevel" for part in parts)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Render `messages` with the checkpoint's template and the variables HF templates use;
        `kwargs` (a request's chat_template_kwargs) add more, or replace a special token's."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        variables = {k: v for k, v in self.special.items() if v is not None}
        variables.update(kwargs, messages=messages, tools=tools)
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(variables)
        except ChatTemplateError:
            raise
        except Exception as err:
            # the template is the checkpoint's code run on the request's data: whatever it raises
            # (a filter given a value of the wrong type, most often) is a request it cannot render
            raise ChatTemplateError(
                f"the chat template failed: {type(err).__name__}: {err}"
            ) from None


class IncrementalDecoder:
    """Text of a growing token sequence, released only in whole characters.

    Byte-level tokens can end in the middle of a multi-byte UTF-8 character; such a tail decodes to
    U+FFFD and is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # tokens before this index are fully emitted...
        self._read = 0  # ...and tokens up to this index were the context of the last emission

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text it makes available (may be '')."""
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read], self.skip)
        full_text = self.tokenizer.decode(self.ids[self._prefix :], self.skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the sequence."""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read], self.skip)
        full_text = self.tokenizer.decode(self.ids[self._prefix :], self.skip)
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text) :]


def _bytes_to_chars() -> dict[int, str]:
    """GPT-2's byte-level map: each byte a printable character (tokenizers' ByteLevel)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_chars().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON: {err}") from None
