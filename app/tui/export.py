"""Exporting a chat to a Markdown file: the default path, the dialog, the write.

Its own module because two places offer it: the chat on screen (`app.tui.chats`) and
any chat in the conversations list (`app.tui.screens.conversations`). What is written
renders: an answer cut inside a code block has the block closed (else the rest of the
file would show as code), the model is named by its own name, not "default", and an
answer's reasoning (in a <details> block) and tool calls are written out.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from textual.app import App

from app.conversations import ChatMessage, Conversation
from app.tui.answer import export_text
from app.tui.model_host import model_name
from app.tui.screens.dialogs import TextInputScreen


def export_path(conversation: Conversation, folder: Path | None = None) -> Path:
    """Where a chat is exported by default: ``~/kvchat-<title words>-<id>.md``."""
    slug = "-".join(re.findall(r"\w+", conversation.title.casefold()))[:40].strip("-")
    name = f"kvchat-{slug}-{conversation.id}.md" if slug else f"kvchat-{conversation.id}.md"
    return (folder or Path.home()) / name


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def close_fences(text: str) -> str:
    """``text`` with a code fence left open at its end closed (CommonMark's rules: a fence
    closes on a line of the same character, at least as long, with nothing after it)."""
    open_fence = None
    for line in text.splitlines():
        match = FENCE.match(line)
        if match is None:
            continue
        fence, rest = match.groups()
        if open_fence is None:
            if not (fence[0] == "`" and "`" in rest):
                open_fence = fence
        elif fence[0] == open_fence[0] and len(fence) >= len(open_fence) and not rest.strip():
            open_fence = None
    return text if open_fence is None else text.rstrip("\n") + "\n" + open_fence


def markdown(conversation: Conversation) -> str:
    """The chat as the Markdown file written (see the module's note)."""
    messages = [ChatMessage(m.role, export_text(close_fences(m.content), m.meta)
                            if m.role == "assistant" else close_fences(m.content), m.meta)
                for m in conversation.messages]
    model = model_name(conversation.model) if conversation.model else None
    return dataclasses.replace(conversation, messages=messages, model=model).to_markdown()


def ask_export(app: App, conversation: Conversation) -> None:
    """Ask where to export ``conversation`` as Markdown, then write it there."""

    def done(path: str | None) -> None:
        if not path:
            return
        target = Path(path).expanduser()
        try:
            target.write_text(markdown(conversation), encoding="utf-8")
        except OSError as e:
            app.notify(str(e), title="Export failed", severity="error")
            return
        app.notify(f"Exported to {target}.", timeout=5)

    app.push_screen(TextInputScreen("Export the chat to Markdown: file",
                                    str(export_path(conversation))), done)
