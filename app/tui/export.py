"""Exporting a chat to a Markdown file: the default path, the dialog, the write.

Its own module because two places offer it: the chat on screen (`app.tui.chats`) and
any chat in the conversations list (`app.tui.screens.conversations`).
"""

from __future__ import annotations

import re
from pathlib import Path

from textual.app import App

from app.conversations import Conversation
from app.tui.screens.dialogs import TextInputScreen


def export_path(conversation: Conversation, folder: Path | None = None) -> Path:
    """Where a chat is exported by default: ``~/kvchat-<title words>-<id>.md``."""
    slug = "-".join(re.findall(r"\w+", conversation.title.casefold()))[:40].strip("-")
    name = f"kvchat-{slug}-{conversation.id}.md" if slug else f"kvchat-{conversation.id}.md"
    return (folder or Path.home()) / name


def ask_export(app: App, conversation: Conversation) -> None:
    """Ask where to export ``conversation`` as Markdown, then write it there."""

    def done(path: str | None) -> None:
        if not path:
            return
        target = Path(path).expanduser()
        try:
            target.write_text(conversation.to_markdown(), encoding="utf-8")
        except OSError as e:
            app.notify(str(e), title="Export failed", severity="error")
            return
        app.notify(f"Exported to {target}.", timeout=5)

    app.push_screen(TextInputScreen("Export the chat to Markdown: file",
                                    str(export_path(conversation))), done)
