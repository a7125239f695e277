"""Prompt token ids through the model's chat template, including pinned-prefix prompts.

A pinned prompt puts a long text (a document) first and the question last, and encodes
the two sides of that boundary apart: the ids before it depend on the system text and the
document only, so every question about the document starts with the same ids and reuses
the document's cached KV blocks (the prefix cache matches whole blocks of equal ids).
"""

from __future__ import annotations

from engine.errors import RequestError
from engine.validation import check_ids, check_scope

# Splits the rendered template at the document's end; never in a document (see pinned_ids).
SPLIT_MARK = "\u241ekvchat-document-end\u241e"


def plain_ids(tokenizer, text: str) -> list[int]:
    """``text``'s ids alone: no template, no BOS (special-token strings still map to ids)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return list(hf.encode(text, add_special_tokens=False))


def chat_ids(tokenizer, prompt: str, *, system: str | None = None, raw: bool = False,
             history: list[dict] | None = None) -> list[int]:
    """Token ids for a user prompt: through the chat template unless ``raw``."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("the prompt is empty")
    if raw or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": system}] if system else []
    messages += (history or []) + [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def messages_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                 extra: dict | None = None) -> list[int]:
    """A whole conversation (any roles the template takes, tool calls and results
    included) through the chat template, with ``tools`` for a template that takes them
    and ``extra`` variables (``enable_thinking``, ``reasoning_effort``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template")
    kwargs = {"tools": tools} if tools else {}
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              **(extra or {}), **kwargs))


def pinned_ids(tokenizer, document: str, question: str, *, system: str,
               history: list[dict] | None = None) -> tuple[list[int], int]:
    """(ids, prefix_len) for ``question`` about ``document``, the document first.

    The document closes the system message; ``history`` turns and the question follow.
    ``ids[:prefix_len]`` is the same for every question and history about one document.
    """
    if not isinstance(question, str) or not question.strip():
        raise RequestError("the question is empty")
    if SPLIT_MARK in document or SPLIT_MARK in question:
        raise RequestError("the text contains kvchat's internal split marker")
    head = f"{system}\n\n{document}" if system else document
    if not getattr(tokenizer, "chat_template", None):
        before = head + "\n\n"
        turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in history or [])
        after = f"{turns}Question: {question}\nAnswer:"
    else:
        messages = [{"role": "system", "content": head + SPLIT_MARK}]
        messages += (history or []) + [{"role": "user", "content": question}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        before, sep, after = rendered.partition(SPLIT_MARK)
        if not sep:  # a template that drops or rewrites the system message
            raise RequestError("this model's chat template does not keep a system message")
    prefix = plain_ids(tokenizer, before)
    return prefix + plain_ids(tokenizer, after), len(prefix)


class PromptMixin:
    """The engine's prompt encoding (it provides ``tokenizer``, ``prefix`` and ``vocab_size``)."""

    def encode_prompt(self, prompt: str, *, system: str | None = None, raw: bool = False,
                      history: list[dict] | None = None) -> list[int]:
        """Token ids for a user prompt: through the chat template unless ``raw``."""
        return chat_ids(self.tokenizer, prompt, system=system, raw=raw, history=history)

    def encode_pinned(self, document: str, question: str, *, system: str,
                      history: list[dict] | None = None) -> tuple[list[int], int]:
        """(ids, prefix_len): ``document`` first, so its blocks serve every question on it."""
        return pinned_ids(self.tokenizer, document, question, system=system,
                                  history=history)

    def prefix_hashes(self, prompt_ids: list[int], *, tenant: str = "local",
                      permission_version: int = 0) -> list[bytes]:
        """Chained hashes of the full blocks of ``prompt_ids`` under this engine's salt
        (what names them in the prefix cache and on disk)."""
        check_scope(tenant, permission_version, None)
        seq = self.prefix.new_sequence(tenant, permission_version)
        return list(self.prefix.hashes(seq, check_ids(prompt_ids, self.vocab_size)))

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes alone (no chat template, no special tokens)."""
        return len(plain_ids(self.tokenizer, text))
