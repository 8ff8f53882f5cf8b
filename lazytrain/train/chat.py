"""Chat records: a conversation rendered with the tokenizer's chat template, and which of its
tokens are the assistant's (the only ones a fine-tune learns)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lazytrain.errors import DataError


def _render(tokenizer, messages: list[dict], generation: bool, where: Callable[[], str]) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
    except Exception as exc:  # jinja and the template raise anything
        message = " ".join(str(exc).split())[:300]
        raise DataError(
            f"{where()}: the tokenizer's chat template cannot render this conversation "
            f"({type(exc).__name__}: {message}); fix the messages"
        ) from None


def chat_example(
    tokenizer, messages: list[dict], where: Callable[[], str]
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of a conversation rendered by the chat template, and which are the
    assistant's (content and what the template closes the turn with).

    An assistant turn spans, in the rendered text, from the end of the conversation before it
    rendered with the generation prompt to the end of the conversation up to it; tokens whose
    first character falls in such a span are supervised. ``where()`` names the record in an
    error (it may scan the file, so only then).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where()}: chat records need a tokenizer with a chat template, and this one has "
            "none; pass --tokenizer with one that has (the model's own, if it is a chat model), "
            'or write {"prompt": ..., "completion": ...} records (their labels are -100 on the '
            "prompt, as a conversation's are outside the assistant's tokens)"
        )
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    full = _render(tokenizer, messages, False, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(
                f"{where()}: the conversation starts with an assistant turn, which has no prompt "
                "to render; start it with a system or user message"
            )
        before = _render(tokenizer, messages[:i], True, where)
        upto = _render(tokenizer, messages[: i + 1], False, where)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"{where()}: the chat template renders turn {i + 1} differently once later turns "
                "follow (e.g. it drops past reasoning), so the assistant's tokens cannot be "
                "located; write one record per assistant turn, or prompt/completion records"
            )
        spans.append((len(before), len(upto)))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DataError(
            f"{where()}: chat records need a fast (Rust) tokenizer to locate the assistant's "
            "tokens; load the tokenizer with use_fast=True"
        )
    encoding = backend.encode(full, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int64)
    starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
    supervised = np.zeros(ids.size, dtype=bool)
    for lo, hi in spans:
        supervised |= (starts >= lo) & (starts < hi)
    return ids, supervised
