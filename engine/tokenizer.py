"""The checkpoint's tokenizer (tokenizers library) and chat template (jinja2), as HF has them."""

from __future__ import annotations

import json
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

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Render `messages` with the checkpoint's template and the variables HF templates use."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **{k: v for k, v in self.special.items() if v is not None},
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None


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


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON: {err}") from None
