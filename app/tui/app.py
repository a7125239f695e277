"""ChatApp: global bindings, theme, model loading and screen routing.

The engine is built in a thread worker (``engine_factory(spec, kv_cache=...)``), so the
UI never waits for a model to load; a switch installs the new engine, then shuts the old
one down, which cancels its requests and gives its KV pool back. A new KV cache format
(F6, settings) takes the same path: the current model is reloaded in it.
"""

from __future__ import annotations

import asyncio
import contextlib

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive
from textual.worker import get_current_worker

from app import models_hub, settings
from app.conversations import ConversationError, ConversationStore
from app.engine_like import EngineLike
from app.tui.commands import KVChatCommands
from app.tui.engine_factory import EngineFactory, default_engine_factory
from app.tui.screens.chat import ChatScreen
from app.tui.screens.conversations import NEW, ConversationDeleted, ConversationsScreen
from app.tui.screens.dialogs import SystemPromptScreen
from app.tui.screens.models import ModelsScreen
from app.tui.screens.settings import SettingsScreen
from app.tui.widgets.cache_panel import CachePanel
from engine import SamplingParams
from engine.errors import KVChatError

__all__ = ["ChatApp", "EngineFactory", "default_engine_factory", "run"]


class ChatApp(App):
    """kvchat's terminal chat: streaming answers, a live KV-cache panel, models, history."""

    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {KVChatCommands}
    BINDINGS = [
        Binding("ctrl+c", "interrupt", "Stop/Quit", priority=True, key_display="^c"),
        Binding("ctrl+q", "quit", "Quit", priority=True, show=False),
        Binding("f2", "toggle_cache", "Cache"),
        Binding("f3", "models", "Models"),
        Binding("f4", "conversations", "Chats"),
        Binding("f5", "system_prompt", "System"),
        Binding("f6", "settings", "Settings"),  # the prompt passes F6 on (PromptInput)
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+t", "toggle_theme", "Theme"),
    ]

    model_status: reactive[str] = reactive("")
    """What the status line says about the model (loading, ready, failed)."""
    model_loading: reactive[bool] = reactive(False)

    def __init__(self, *, model: str | None = None, engine_factory: EngineFactory | None = None,
                 store: ConversationStore | None = None, max_tokens: int = 512,
                 temperature: float = 0.0, conversation_id: str | None = None,
                 remember: bool = True):
        super().__init__()
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

    @property
    def chat(self) -> ChatScreen:
        return self.get_screen("chat")  # type: ignore[return-value]

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature)

    def on_mount(self) -> None:
        saved = settings.load_settings() if self.remember else settings.AppSettings()
        if saved.theme in self.available_themes:
            self.theme = saved.theme
        self.kv_cache = saved.kv_cache
        conversation = self.store.new()
        if self.conversation_id:
            try:
                conversation = self.store.load(self.conversation_id)
            except ConversationError as e:
                self.notify(str(e), severity="error")
        self.install_screen(ChatScreen(conversation), "chat")
        self.push_screen("chat")
        spec = self.requested_model or (settings.last_model() if self.remember else None)
        self.load_model(spec, fallback=self.requested_model is None and spec is not None)

    # -- models --------------------------------------------------------------------
    def load_model(self, spec: str | None, *, fallback: bool = False) -> None:
        """Load a model in a worker; ``fallback``: on failure, load the default instead."""
        name = spec or models_hub.DEFAULT_MODEL
        self.model_loading = True
        self.loading_spec = spec
        self.model_status = f"loading model {name}…"
        self._load_worker(spec, fallback, self.kv_cache)

    @work(thread=True, exclusive=True, group="model", exit_on_error=False)
    def _load_worker(self, spec: str | None, fallback: bool, kv_cache: str | None) -> None:
        worker = get_current_worker()
        try:
            engine = self.engine_factory(spec, kv_cache=kv_cache)
            engine.start()
        except Exception as e:  # ModelLoadError, a bad directory, out of memory...
            text = str(e) if isinstance(e, KVChatError | ValueError | OSError) else repr(e)
            self.call_from_thread(self._load_failed, spec, text, fallback)
            return
        if worker.is_cancelled:  # another load started meanwhile
            engine.shutdown()
            return
        old = self.call_from_thread(self._install_engine, engine, spec)
        if old is not None and old is not engine:
            old.shutdown()  # cancels its requests and releases its whole pool

    def _install_engine(self, engine: EngineLike, spec: str | None) -> EngineLike | None:
        old, self.engine = self.engine, engine
        old_name, self.model_name = self.model_name, spec or models_hub.DEFAULT_MODEL
        self.model_loading = False
        self.model_status = self._describe_model()
        if self.remember:
            with contextlib.suppress(OSError):
                settings.remember_model(self.model_name)
        for notice in getattr(engine, "notices", ()):  # e.g. a KV format that fell back
            self.notify(notice, title="Note", timeout=10)
        if old is not None:
            done = "Reloaded" if old_name == self.model_name else "Switched to"
            self.notify(f"{done} {self.model_name}.", timeout=3)
        return old

    def _describe_model(self) -> str:
        loaded = getattr(self.engine, "loaded", None)
        fmt = getattr(loaded, "weight_format", "")
        return f"{self.model_name}" + (f" ({fmt})" if fmt else "")

    def _load_failed(self, spec: str | None, error: str, fallback: bool) -> None:
        self.notify(error, title=f"Cannot load {spec or 'the default model'}",
                    severity="error", timeout=10)
        if fallback and spec is not None:
            self.load_model(None)
            return
        self.model_loading = False
        self.model_status = (self._describe_model() if self.engine is not None
                             else "no model loaded — F3 picks one")

    # -- actions -------------------------------------------------------------------
    def action_interrupt(self) -> None:
        """Ctrl+C: cancel a running answer; quit only when idle (the chat is saved)."""
        if self.is_screen_installed("chat") and self.chat.generating:
            self.chat.action_cancel_generation()
            return
        self.call_later(self.action_quit)

    async def action_quit(self) -> None:
        if self.is_screen_installed("chat"):
            self.chat.save()
        await self.stop_engine()
        self.exit()

    async def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    def on_unmount(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def action_toggle_cache(self) -> None:
        panel = self.chat.query_one(CachePanel)
        panel.display = not panel.display
        panel.poll()

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
            if name is not None:
                self.load_model(name)

        self.push_screen(ModelsScreen(current=self.model_name), chosen)

    def action_conversations(self) -> None:
        if isinstance(self.screen, ConversationsScreen):
            return

        async def chosen(cid: str | None) -> None:
            if cid == NEW:
                await self.action_new_chat()
            elif cid is not None:
                await self.open_conversation(cid)

        self.push_screen(ConversationsScreen(self.store), chosen)

    def _idle(self, what: str) -> bool:
        if self.chat.generating:
            self.notify(f"An answer is being written: press Esc before {what}.",
                        severity="warning")
            return False
        return True

    async def open_conversation(self, conversation_id: str) -> None:
        if not self._idle("opening another chat"):
            return
        try:
            conversation = self.store.load(conversation_id)
        except ConversationError as e:
            self.notify(str(e), severity="error")
            return
        await self.chat.show_conversation(conversation)

    async def action_new_chat(self) -> None:
        if self._idle("starting a new chat"):
            await self.chat.show_conversation(self.store.new())

    async def on_conversation_deleted(self, message: ConversationDeleted) -> None:
        if self.chat.conversation.id == message.conversation_id and not self.chat.generating:
            await self.chat.show_conversation(self.store.new())

    # -- settings ------------------------------------------------------------------
    def action_settings(self) -> None:
        if isinstance(self.screen, SettingsScreen):
            return
        in_use = self.engine.metrics().kv_format if self.engine is not None else ""
        self.push_screen(SettingsScreen(self.kv_cache, in_use), self.set_kv_cache)

    def set_kv_cache(self, name: str | None) -> None:
        """Use the KV cache format ``name`` from now on: save it, reload the model in it.

        The reload goes the model-switch way (new engine in, old one shut down), so the
        chat is kept; it waits for an answer being written, which it would cut short.
        """
        if name is None or name == (self.kv_cache or "float"):
            return
        if not self._idle("changing the KV cache"):
            return
        self.kv_cache = name
        if self.remember:
            try:
                settings.save_settings(kv_cache=name)
            except OSError as e:  # still used for this run
                self.notify(f"Could not save the setting: {e}", severity="warning", timeout=4)
        if self.engine is None and not self.model_loading:
            self.notify(f"KV cache {name}: it applies when a model loads (F3).")
            return
        spec = self.loading_spec if self.model_loading else self.model_name
        self.notify(f"KV cache {name}: reloading the model.", timeout=3)
        self.load_model(spec)

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


def run(**kwargs) -> int:
    """Run the chat until the user quits."""
    ChatApp(**kwargs).run()
    return 0
