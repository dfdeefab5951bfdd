"""Tokenizer and incremental detokenizer, against transformers' tokenizer converted from the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from tokenizers import processors
from transformers import AutoTokenizer

from pagewise.engine.loader import DEFAULT_MODEL, resolve_model_path
from pagewise.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    "Emoji 😀👍🏽🇯🇵 family 👨‍👩‍👧 and math ∑∫√ café naïve Ελληνικά",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]
MULTIBYTE = "Emoji 😀👍🏽 and CJK 你好世界, flags 🇯🇵🇫🇷, family 👨‍👩‍👧, math ∑∫ — done. 🎉"


@pytest.fixture(scope="session")
def reference():
    """transformers' own conversion of the GGUF tokenizer."""
    path = resolve_model_path(DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Ours, converted from the GGUF, saved and loaded back (the warm path: no transformers involved)."""
    converted = Tokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL), eos_token_ids=(2,))
    path = tmp_path_factory.mktemp("tokenizer")
    converted.save(path)
    return Tokenizer.from_pretrained(path)


def test_attributes(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.eos_token_ids == (2,) == (reference.eos_token_id,)
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.vocab_size == len(reference) == 49152
    assert tokenizer.chat_template == reference.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer: Tokenizer, reference, text: str) -> None:
    for add_special_tokens in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )
    if "<|im_start|>" not in text:
        assert tokenizer.decode(ids) == text  # byte-level BPE round-trips exactly


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀 你好"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, reference, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == list(
        expected
    )


def test_chat_template_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"role": "user"}], [{"content": "hi"}], [{"role": "user", "content": 3}], ["hi"]],
)
def test_chat_template_rejects_malformed_messages(tokenizer: Tokenizer, messages) -> None:
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template(messages)


def test_chat_template_missing_or_raising(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tokenizer.save(tmp_path)
    plain = Tokenizer.from_pretrained(tmp_path)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    strict = Tokenizer.from_pretrained(tmp_path)
    strict.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    )
    with pytest.raises(ValueError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_saved_tokenizer_loads_in_transformers(tokenizer: Tokenizer, reference, tmp_path: Path) -> None:
    tokenizer.save(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.encode(MULTIBYTE) == reference.encode(MULTIBYTE)
    assert reloaded.chat_template == reference.chat_template
    assert reloaded.eos_token_id == reference.eos_token_id


def test_post_processor_decides_added_special_tokens(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """A Llama-style tokenizer.json that adds BOS: encode adds it, as transformers does."""
    tokenizer.save(tmp_path)
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    with_bos = Tokenizer.from_pretrained(tmp_path)
    assert with_bos.encode("hi") == [1, *tokenizer.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tokenizer.encode("hi")
    assert AutoTokenizer.from_pretrained(tmp_path).encode("hi") == with_bos.encode("hi")
    # chat templates add no special tokens beyond what the template writes
    assert with_bos.apply_chat_template([{"role": "user", "content": "hi"}]) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


def _stream(tokenizer: Tokenizer, prompt: str, output_ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens=skip)
    deltas = [detok.push(i) for i in output_ids]
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("prompt", ["", "Say something: ", "前置き😀"])
@pytest.mark.parametrize("text", [MULTIBYTE, *TEXTS])
def test_incremental_detokenizer_never_splits_characters(
    tokenizer: Tokenizer, prompt: str, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        deltas = _stream(tokenizer, prompt, ids, skip)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_waits_for_complete_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits this emoji across tokens
    deltas = _stream(tokenizer, "x", ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_incremental_detokenizer_flush_emits_incomplete_tail(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab😀")
    detok = IncrementalDetokenizer(tokenizer, [])
    partial = "".join(detok.push(i) for i in ids[:-1])
    assert partial == "ab"
    assert detok.flush() == tokenizer.decode(ids[:-1])[len("ab") :]
    assert detok.flush() == ""
    assert detok.text.startswith("ab") and detok.text.endswith("\ufffd")


def test_incremental_detokenizer_window_stays_small(tokenizer: Tokenizer) -> None:
    """O(1) per token: the ids kept for decoding do not grow with the output."""
    ids = tokenizer.encode("word " * 500)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt " * 100))
    for i in ids:
        detok.push(i)
        assert len(detok._ids) <= 8
    assert detok.text == tokenizer.decode(ids)
