"""A thinking budget: after so many tokens inside ``<think>``, ``</think>`` is forced.

Reasoning models write their thoughts between think tags before the answer; a request
with a budget lets them think for at most that many tokens, then the engine feeds the
closing tag's tokens as the next picks (whatever the sampler would have drawn), so the
answer follows. The tag is found in the streamed text, so it works whether the tags are
special tokens or plain text, and whether the template opened the tag in the prompt
(``inside``) or the model opens it as its first words. A request whose answer does not
start with a think tag is left alone.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
CLOSE_TEXT = "\n</think>\n\n"


def close_ids(tokenizer) -> list[int]:
    """The tokens forced to close a thought (no special tokens added)."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    return list(tok.encode(CLOSE_TEXT, add_special_tokens=False))


class ThinkBudget:
    """Counts a request's thinking tokens and says which token must come next, if any."""

    def __init__(self, budget: int, close: list[int], *, inside: bool):
        assert budget >= 0 and close
        self.budget, self.close = budget, list(close)
        self.state = "start"  # start -> thinking -> done (closed, forced shut, or no tag)
        self.text = ""  # the answer's start (to find the tag), then the thought's tail
        self.used = 0  # tokens generated inside the tag
        self.forced: list[int] = []  # the closing tokens still to emit
        if inside:
            self._open("")

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def next_forced(self) -> int | None:
        """The token that must be picked next, or None."""
        return self.forced[0] if self.forced else None

    def _open(self, rest: str) -> None:
        self.state, self.text = "thinking", rest
        if self.budget == 0:
            self.forced = list(self.close)

    def feed(self, token: int, text: str) -> None:
        """Account for an accepted token and the text it released."""
        if self.forced:
            if token == self.forced[0]:
                self.forced.pop(0)
            if not self.forced:
                self.state = "done"
            return
        if self.state == "start":
            self.text += text
            head = self.text.lstrip()
            if head.startswith(OPEN):
                self._open(head[len(OPEN):])
            elif head and not OPEN.startswith(head):
                self.state = "done"
            return
        if self.state == "thinking":
            self.used += 1
            self.text = (self.text + text)[-4 * len(CLOSE):]
            if CLOSE in self.text:
                self.state = "done"
            elif self.used >= self.budget:
                self.forced = list(self.close)
