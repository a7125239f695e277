"""kvchat's Textual TUI: `ChatApp` and `run`."""

from app.tui.app import ChatApp, run

__all__ = ["ChatApp", "run"]
