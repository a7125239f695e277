"""Reasoning apart from the answer: ``<think>…</think>`` split off the answer's text.

Models of the DeepSeek-R1 / Qwen3 / SmolLM3 kind write their reasoning between think tags
before the answer; some templates open the tag in the generation prompt themselves, so the
answer begins inside it. Whole answers split once; streams route each piece of text to the
reasoning or the answer as it comes, holding back only what may be the start of a tag. The
server sends them as ``reasoning_content`` and ``content``; the chat folds the reasoning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the answer inside an opened think tag."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def split(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer; ``inside``: it starts in a tag."""
    if not inside:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        text = stripped[len(OPEN):]
    reasoning, sep, content = text.partition(CLOSE)
    if not sep:  # cut while still thinking: all of it is reasoning
        return reasoning.strip(), ""
    return reasoning.strip(), content.lstrip()


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Routes streamed text: ``feed`` returns (reasoning, content) safe to send now."""

    def __init__(self, inside: bool = False):
        self.state = "thinking" if inside else "start"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                stripped = self.held.lstrip()
                if stripped.startswith(OPEN):
                    self.held, self.state = stripped[len(OPEN):].lstrip("\n"), "thinking"
                    continue
                if not stripped or OPEN.startswith(stripped):
                    return reasoning, content  # may still become "<think>"
                self.state = "answer"
            if self.state == "thinking":
                before, sep, after = self.held.partition(CLOSE)
                if sep:
                    reasoning += before
                    self.held, self.state = after.lstrip(), "answer"
                    continue
                keep = partial_tail(self.held, CLOSE)
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, content
            content += self.held
            self.held = ""
            return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is left at the end: held text goes where its state says."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "thinking" else ("", held)
