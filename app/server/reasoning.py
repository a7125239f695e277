"""Reasoning as ``reasoning_content``: the splitter lives in `app.reasoning` (the chat uses
it too); the server's modules import it from here."""

from __future__ import annotations

from app.reasoning import CLOSE, OPEN, ReasoningStream, opens_thinking, split

__all__ = ["CLOSE", "OPEN", "ReasoningStream", "opens_thinking", "split"]
