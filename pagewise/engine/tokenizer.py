"""Tokenizer (an HF fast tokenizer plus chat template and EOS ids) and incremental detokenization.

The runtime object is a Rust ``tokenizers.Tokenizer``; transformers is imported only to *convert* a tokenizer
that has no ``tokenizer.json`` (a GGUF file, a sentencepiece-only directory), so loading a saved tokenizer is
fast. Chat templates render the way transformers renders them (sandboxed Jinja, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``, special tokens as variables).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# How many prompt tokens the detokenizer decodes before the first output token, so that the first output
# token's leading space (sentencepiece) or merged bytes come out as they would in the full text (as in vLLM).
_INITIAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Wraps an HF fast tokenizer.

    ``hf_tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (its backend tokenizer,
    chat template and special tokens are taken over; explicit keyword arguments win). Invariants:
    ``eos_token_ids`` is a non-empty tuple of ids in the vocabulary; ``bos_token_id`` is the id of the BOS
    token or ``None``; ``vocab_size`` counts added tokens too (the largest id is ``vocab_size - 1``).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        eos_token_ids: tuple[int, ...],
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        if isinstance(hf_tokenizer, tokenizers.Tokenizer):
            backend = hf_tokenizer
        elif isinstance(getattr(hf_tokenizer, "backend_tokenizer", None), tokenizers.Tokenizer):
            backend = hf_tokenizer.backend_tokenizer
            if chat_template is None and isinstance(hf_tokenizer.chat_template, str):
                chat_template = hf_tokenizer.chat_template
            if special_tokens is None:
                special_tokens = {
                    k: v for k, v in hf_tokenizer.special_tokens_map.items() if isinstance(v, str)
                }
        else:
            raise TypeError(
                f"expected a tokenizers.Tokenizer or a transformers fast tokenizer, got {hf_tokenizer!r}"
            )
        self._tokenizer: tokenizers.Tokenizer = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in eos_token_ids)
        if not self.eos_token_ids or any(not 0 <= i < self.vocab_size for i in self.eos_token_ids):
            raise ValueError(
                f"eos_token_ids must be non-empty ids below {self.vocab_size}, got {eos_token_ids!r}"
            )
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if k in _SPECIAL_TOKEN_NAMES and v
        }
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        self.chat_template: str | None = chat_template

    @classmethod
    def from_pretrained(cls, path: str | Path, eos_token_ids: tuple[int, ...] | None = None) -> Tokenizer:
        """Load from an HF tokenizer directory (written by ``save`` or by transformers) or a ``.gguf`` file.

        A directory with ``tokenizer.json`` loads without transformers; its post-processor alone decides which
        special tokens ``encode`` adds (as transformers v5 does for a generic fast tokenizer). EOS ids, unless
        given, come from ``generation_config.json``, then ``config.json``, then the tokenizer's ``eos_token``.
        """
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
            return cls(hf, eos_token_ids or (int(hf.eos_token_id),))
        if not path.is_dir():
            raise FileNotFoundError(f"no tokenizer at {path}: expected a directory or a .gguf file")
        if not (path / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path))
            if not isinstance(getattr(hf, "backend_tokenizer", None), tokenizers.Tokenizer):
                raise ValueError(f"tokenizer at {path} has no fast (Rust) implementation")
            return cls(hf, eos_token_ids or _eos_ids_from_dir(path, hf.backend_tokenizer, hf.eos_token))

        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special = {name: tok for name in _SPECIAL_TOKEN_NAMES if (tok := _token_content(config.get(name)))}
        eos_ids = eos_token_ids or _eos_ids_from_dir(path, backend, special.get("eos_token"))
        return cls(backend, eos_ids, chat_template=_read_chat_template(path, config), special_tokens=special)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The Rust tokenizer itself (what `tokenizer.json` serializes)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the post-processor adds (Llama's BOS)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (without transformers' optional space clean-up)."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template (no special tokens added)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        template = _compile_chat_template(self.chat_template)
        try:
            text = template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        return self.encode(text, add_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template) and
        ``generation_config.json`` (EOS ids) so that ``from_pretrained(path)`` rebuilds an equal tokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(path / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(self.eos_token_ids)}))


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; never emits half of a multi-byte character.

    vLLM's scheme: only the ids in ``[prefix_offset, len(ids))`` are decoded per push, where ``prefix_offset``
    trails the last emitted token, so each push costs O(window) and the window resets once text is emitted.
    A decode ending in U+FFFD means a character is still incomplete, so nothing is emitted until it is.
    Invariant: ``text`` is the concatenation of every delta returned; for well-formed output it equals
    ``tokenizer.decode(output ids)`` (the last few prompt tokens serve only as decoding context).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters as context; keep just that much.
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_DETOKENIZATION_OFFSET:])
        self._read_offset = len(self._ids)  # ids before this are already turned into text
        self._prefix_offset = 0  # decoding starts here, for context
        self.text: str = ""

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly finalized text (possibly ``""``)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of a stream: emit whatever is still pending, even an incomplete (U+FFFD) character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        return self._emit(new_text[len(prefix_text) :])

    def _emit(self, delta: str) -> str:
        # Drop ids that no longer serve as context so the list does not grow with the output.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _eos_ids_from_dir(path: Path, backend: tokenizers.Tokenizer, eos_token: str | None) -> tuple[int, ...]:
    """EOS ids: ``generation_config.json``, else ``config.json``, else the tokenizer's ``eos_token``."""
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(path / name).get("eos_token_id")
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and eos:
            return tuple(int(i) for i in eos)
    eos_id = backend.token_to_id(eos_token) if eos_token else None
    if eos_id is None:
        raise ValueError(f"cannot tell the EOS token of the tokenizer at {path}")
    return (eos_id,)


def _read_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja`` (transformers v5), else the configs' entry."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}]['{key}'] must be a string")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile as transformers does, so prompts match its ``apply_chat_template`` character for character."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the model's chat template does not compile: {exc}") from exc
