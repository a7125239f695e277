"""ChatApp: global bindings, theme, model loading and screen routing.

Engines come and go through `ModelHost` (load in a worker, switch, a clean stop at quit);
chats through `ChatsHost` (open, new, rename, export, reopen the last one); F6 through
`SettingsHost` (a chat's sampling; a new KV cache format reloads the model in it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from platformdirs import user_downloads_path
from textual import events, on
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from app import settings
from app.conversations import ConversationStore
from app.engine_like import EngineLike
from app.tui.chats import ChatsHost
from app.tui.commands import KVChatCommands
from app.tui.engine_factory import EngineFactory, default_engine_factory
from app.tui.model_host import LoadThreads, ModelHost, finish_mlx_work
from app.tui.screens.chat import ChatScreen
from app.tui.screens.dialogs import SystemPromptScreen
from app.tui.screens.help import HelpScreen
from app.tui.screens.models import ModelsScreen
from app.tui.settings_host import SettingsHost
from app.tui.widgets.cache_panel import CachePanel
from app.tui.widgets.transcript import MessageBox

DROPPED_SYSTEM_COMMANDS = frozenset({"Quit", "Keys"})
SETTLE_S = 30.0  # the longest quit waits for the chat to take in a turn's end
DELIVERY_S = 10.0  # the longest quit waits for a screenshot being written

__all__ = ["ChatApp", "EngineFactory", "default_engine_factory", "run"]


class ChatApp(SettingsHost, ModelHost, ChatsHost):
    """kvchat's terminal chat: streaming answers, a live KV-cache panel, models, history."""

    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {KVChatCommands}
    # The footer shows what fits in 80 columns; F1 (help) lists every key, these included.
    BINDINGS = [
        Binding("ctrl+c", "interrupt", "Quit", priority=True, key_display="^c",
                tooltip="Copies the selection; else cancels; else quits (twice: quits)"),
        Binding("ctrl+q", "quit", "Quit (always)", priority=True, show=False),
        Binding("f1,question_mark", "help", "Help", key_display="f1"),
        Binding("f2", "toggle_cache", "Cache",
                tooltip="Show the KV-cache panel, or its one-line summary"),
        Binding("f3", "models", "Models",
                tooltip="Load, download or delete a model"),
        # priority: the list opens before the keys typed after F4 in the same burst are
        # handed on (they went to the prompt behind it, not to the list's search)
        Binding("f4", "conversations", "Chats", priority=True,
                tooltip="Search, open, rename, export or delete a saved chat"),
        Binding("f5", "system_prompt", "System prompt", show=False),
        # the prompt passes F6 on (PromptInput)
        Binding("f6", "settings", "Settings",
                tooltip="This chat's sampling settings and the KV cache format"),
        Binding("ctrl+n", "new_chat", "New",
                tooltip="Start a new chat"),
        Binding("ctrl+t", "toggle_theme", "Light/dark theme", show=False),
        Binding("ctrl+p", "command_palette", "Commands", show=False,
                tooltip="The command palette: every command, searchable"),
    ]

    def __init__(self, *, model: str | None = None, engine_factory: EngineFactory | None = None,
                 store: ConversationStore | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, conversation_id: str | None = None,
                 remember: bool = True, context_policy: str = "summarize",
                 context_budget: int | None = None):
        super().__init__()
        self.context_policy, self.context_budget = context_policy, context_budget
        self.engine_factory = engine_factory or default_engine_factory
        self.store = store or ConversationStore()
        self.max_tokens, self.temperature = max_tokens, temperature
        self.remember = remember
        self.requested_model = model
        self.conversation_id = conversation_id
        self.engine: EngineLike | None = None
        self.model_name: str | None = None
        self.loading_spec: str | None = None  # the spec of the load in progress
        self.kv_cache: str | None = None  # the settings' KV format for engines; None: the config's
        self.load_threads = LoadThreads()
        self.double_ctrl_c_s = 1.0  # a second Ctrl+C within this always quits
        self._last_ctrl_c = float("-inf")
        self.deliveries: set[str] = set()  # screenshots being written by Textual's threads

    def on_mount(self) -> None:
        saved = settings.load_settings() if self.remember else settings.AppSettings()
        if saved.theme in self.available_themes:
            self.theme = saved.theme
        self.kv_cache = saved.kv_cache
        self.saved_generation = saved.generation
        self.install_screen(ChatScreen(self.initial_conversation(self.conversation_id)), "chat")
        self.push_screen("chat")
        spec = self.requested_model or (settings.last_model() if self.remember else None)
        self.load_model(spec, fallback=self.requested_model is None and spec is not None)

    def on_engine_installed(self) -> None:
        if self.is_screen_installed("chat"):
            self.chat.query_one(CachePanel).last_turn = None  # it was the old engine's

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """Ctrl+P → Screenshot: to ~/Downloads, or the home folder where there is none."""
        if path is None:
            downloads = user_downloads_path()
            path = str(downloads if downloads.is_dir() else Path.home())
        key = super().deliver_screenshot(filename, path, time_format)
        if key is not None:
            self.deliveries.add(key)
        return key

    @on(events.DeliveryComplete)
    @on(events.DeliveryFailed)
    def delivery_ended(self, event: events.DeliveryComplete | events.DeliveryFailed) -> None:
        self.deliveries.discard(event.key)

    async def finish_deliveries(self, timeout: float = DELIVERY_S) -> None:
        """Wait until the screenshots being written are on disk (or failed).

        Textual's save thread is not a daemon and hands its result to the app's loop,
        waiting for it: a screenshot taken just before a quit was cut short by the
        process's end, or, with the loop gone, left that thread (and the process) waiting.
        """
        deadline = time.monotonic() + timeout
        while self.deliveries and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # Textual's "Quit" exits at once (no save, no engine stop) and its "Keys" panel
        # duplicates F1: the palette lists kvchat's own ("Quit kvchat", "Help") instead
        for command in super().get_system_commands(screen):
            if command.title not in DROPPED_SYSTEM_COMMANDS:
                yield command

    # -- actions -------------------------------------------------------------------
    def action_interrupt(self) -> None:
        """Ctrl+C: copy the selection (text, or a message selected with ↑); else cancel the
        question on; else quit. A second Ctrl+C within a second always quits."""
        now = time.monotonic()
        double, self._last_ctrl_c = now - self._last_ctrl_c <= self.double_ctrl_c_s, now
        if double:
            self.call_later(self.action_quit)
            return
        # decided once the focused widget has handled the keys before this one (an Enter
        # just typed is a question on its way: Ctrl+C cancels it rather than quitting)
        (self.focused or self.screen).call_later(self._interrupt)

    async def _interrupt(self) -> None:
        if self.closing:
            return
        focused = self.focused
        selected = self.screen.get_selected_text()
        if not selected and focused is not None:
            selected = getattr(focused, "selected_text", "")  # the prompt's selection
        if not selected and isinstance(focused, MessageBox):
            selected = focused.copy_text
        if selected:
            self.copy_to_clipboard(selected)
            self.notify(f"Copied {len(selected):,} characters (Ctrl+C twice quits).",
                        timeout=2)
            return
        if self.is_screen_installed("chat") and self.chat.cancel_turn():
            return
        await self.action_quit()

    async def action_quit(self) -> None:
        """Save the chat, stop the engine and wait for MLX work, then exit.

        It runs in a worker, so the UI stays live (and says so) while a model load that
        cannot be interrupted finishes. From here on no question is sent and no model
        installed; the chat settles (a turn's end taken in) before the screen goes.
        """
        if self.closing:
            return  # a second Ctrl+C while the engine stops: the first quit goes on
        self.closing = True
        if self.is_screen_installed("chat"):
            self.chat.save()
        self.model_status = "quitting…"
        self.run_worker(self._quit(), group="quit", exit_on_error=False)

    async def _quit(self) -> None:
        try:
            await self.finish_work()
            if self.is_screen_installed("chat"):
                await self.chat.settle(SETTLE_S)
            await self.finish_deliveries()
        finally:
            self.exit()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_json(self) -> None:
        self.chat.set_json_mode(not self.chat.json_mode)

    def action_toggle_cache(self) -> None:
        self.chat.toggle_cache()

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"
        if self.remember:
            try:
                settings.save_settings(theme=self.theme)
            except OSError as e:  # a read-only cache root must not end the chat
                self.notify(f"Could not save the theme: {e}", severity="warning", timeout=4)

    def action_cancel_generation(self) -> None:
        self.chat.action_cancel_generation()

    def action_models(self) -> None:
        if isinstance(self.screen, ModelsScreen):
            return

        def chosen(name: str | None) -> None:
            if name is None:
                return
            if name == self.model_name and self.engine is not None and not self.model_loading:
                self.notify(f"{name} is already loaded.", timeout=3)
                return
            self.load_model(name)

        self.push_screen(ModelsScreen(current=self.model_name), chosen)

    def action_attach_document(self) -> None:
        """Pick a document to attach to the chat (the palette's entry; also ``/doc``)."""
        self.chat.documents.pick()

    def action_detach_document(self) -> None:
        self.chat.documents.detach()

    def action_system_prompt(self) -> None:
        if isinstance(self.screen, SystemPromptScreen):
            return

        def done(text: str | None) -> None:
            if text is None:
                return
            self.chat.conversation.system_prompt = text
            self.chat.save()
            self.chat.update_status()
            self.notify("System prompt saved." if text else "System prompt cleared.")

        self.push_screen(SystemPromptScreen(self.chat.conversation.system_prompt), done)


def run(*, exit_process: bool = True, **kwargs) -> int:
    """Run the chat until the user quits; MLX work is finished before it ends.

    With ``exit_process`` (the CLI) the process ends here, by `exit_now`, with the app's
    status. Without it the status is returned.
    """
    app = run_app(**kwargs)
    code = app.return_code or 0
    if exit_process:
        exit_now(code)
    return code


def run_app(*, headless: bool = False, auto_pilot=None, **kwargs) -> ChatApp:
    """Run a `ChatApp` built from ``kwargs`` to its end and finish MLX's queued work."""
    app = ChatApp(**kwargs)
    try:
        app.run(headless=headless, auto_pilot=auto_pilot)
    finally:
        finish_mlx_work()  # nothing may still run in MLX while the interpreter exits
    return app


def exit_now(code: int) -> None:
    """End the process by ``os._exit`` once logs and streams are flushed.

    Called once the chat is saved, every engine shut down (its thread joined), every
    model load waited for and MLX synchronized: all that is left is the interpreter's
    finalization, and a native thread still running then (an MLX stream thread finishing
    work a loader queued, a BLAS or extension pool) aborts the process with "terminate
    called without an active exception", exit 134, a quit that was otherwise clean.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
