"""The command palette's kvchat commands (Ctrl+P)."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, help, action name on ChatApp)
COMMANDS = [
    ("Help", "Every key of the chat (F1 or ?)", "help"),
    ("New chat", "Start a new conversation (ctrl+n)", "new_chat"),
    ("Conversations", "Search, open, rename, export or delete a saved chat (F4)",
     "conversations"),
    ("Rename chat", "Give this chat another title", "rename_chat"),
    ("Export chat", "Write this chat to a Markdown file", "export_chat"),
    ("Models", "Load, download or delete a model (F3)", "models"),
    ("Toggle cache panel", "Show or hide the live KV-cache panel (F2)", "toggle_cache"),
    ("Edit system prompt", "Set this conversation's system prompt (F5)", "system_prompt"),
    ("Attach document", "Pick a text, Markdown or PDF file to ask about (/doc FILE)",
     "attach_document"),
    ("Detach document", "Questions go to the model alone again (/doc off)", "detach_document"),
    ("JSON answers on/off", "Answers as JSON objects, by constrained decoding (/json, "
                            "/json off)", "toggle_json"),
    ("Settings", "This chat's temperature, top-p, max tokens and repetition penalty; "
                 "the KV cache format (F6)", "settings"),
    ("Toggle light/dark theme", "Switch between the light and the dark theme (ctrl+t)",
     "toggle_theme"),
    ("Cancel answer", "Stop the answer being written (Esc or ctrl+c)", "cancel_generation"),
    ("Quit kvchat", "Save the chat and quit (ctrl+q)", "quit"),
]


class KVChatCommands(Provider):
    """kvchat's own actions, searchable by title."""

    def _run(self, action: str) -> None:
        self.app.call_later(self.app.run_action, action)

    async def discover(self) -> Hits:
        for title, help_text, action in COMMANDS:
            yield DiscoveryHit(title, partial(self._run, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in COMMANDS:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self._run, action),
                          help=help_text)
