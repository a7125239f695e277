"""The chat screen: transcript, prompt, prefill bar, status line and the cache panel.

How a question is sent (and cancelled before it reaches the engine) is `chat_send`; how a
turn ends (and what of it the chat keeps) is `chat_turns`; what can be done with a message
(copy, retry, edit, delete) is `chat_actions`.
"""

from __future__ import annotations

from typing import Protocol, cast

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, ProgressBar, Static

from app.conversations import ChatMessage, Conversation, ConversationStore
from app.engine_like import EngineLike
from app.tui.generation import Turn
from app.tui.screens.chat_actions import MessageActions
from app.tui.screens.chat_send import TurnStart
from app.tui.screens.chat_summary import SummaryEvents, summary_marker
from app.tui.screens.chat_turns import TurnEvents
from app.tui.widgets.cache_panel import CachePanel, CacheSummary
from app.tui.widgets.document_bar import DocumentBar
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox, Transcript
from engine import SamplingParams

HINT = ("Type a message and press Enter. Ctrl+J adds a newline, Esc cancels an answer, "
        "↑ selects a message (c copies, r retries, e edits, d deletes), /doc FILE attaches "
        "a document, F1 lists every key.")
NARROW_COLS = 100  # below this the cache panel starts collapsed to one line (F2 expands it)


class ChatHost(Protocol):
    """What the chat screen needs from its app (`ChatApp` provides it).

    The screen also watches the app's ``model_status`` and ``model_loading`` reactives.
    Typing against this, not the app class, keeps the screen free of an import of it.
    """

    engine: EngineLike | None
    store: ConversationStore
    model_name: str | None
    model_status: str

    def sampling(self) -> SamplingParams: ...

    def remember_chat(self, conversation_id: str | None) -> None: ...


class ChatScreen(TurnStart, TurnEvents, SummaryEvents, MessageActions, Screen):
    """One conversation with the loaded model; generation runs in a thread worker."""

    BINDINGS = [Binding("escape", "cancel_generation", "Cancel")]
    # the prompt has the focus from the first frame: keys typed during start-up (the
    # terminal delivers them then) went to the transcript, the first focusable widget
    AUTO_FOCUS = "#prompt"
    hint = HINT

    def __init__(self, conversation: Conversation):
        super().__init__()
        self.conversation = conversation
        self.turn: Turn | None = None
        self.answer: MessageBox | None = None
        self.user_box: MessageBox | None = None
        self.editing: ChatMessage | None = None
        self.cache_expanded: bool | None = None  # None: by the width; F2 sets it
        self.prompt_input = PromptInput(id="prompt", placeholder="Ask anything…")

    @property
    def chat_app(self) -> ChatHost:
        return cast(ChatHost, self.app)

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="chat-column"):
                yield Transcript(id="transcript")
                with Horizontal(id="prefill"):
                    yield Static("prefill", id="prefill-label")
                    yield ProgressBar(id="prefill-bar", show_eta=False)
                yield DocumentBar(id="doc-bar")
                yield self.prompt_input
                yield CacheSummary(id="cache-summary")
                with Horizontal(id="status-row"):
                    yield LoadingIndicator(id="model-spinner")
                    yield Static(id="status")
            yield CachePanel(id="cache-panel")
        # the palette's key is in the help (F1): docked right, it covered the keys at 80 cols
        yield Footer(compact=True, show_command_palette=False)

    async def on_mount(self) -> None:
        self.query_one("#prefill").display = False
        self.show_cache()
        await self.show_conversation(self.conversation)
        self.watch(self.app, "model_status", self.update_status)
        self.watch(self.app, "model_loading", self._show_spinner)
        self.prompt_input.focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_generation":  # Esc: cancel an answer, an edit, or leave a message
            return (self.generating or self.editing is not None
                    or isinstance(self.focused, MessageBox))
        return True

    # -- the cache panel ----------------------------------------------------------
    def show_cache(self, expanded: bool | None = None) -> None:
        """Show the full panel or the one-line summary (``expanded`` None: by the width)."""
        if expanded is None:
            expanded = self.cache_expanded
        if expanded is None:
            expanded = self.app.size.width >= NARROW_COLS
        panel, summary = self.query_one(CachePanel), self.query_one(CacheSummary)
        panel.display, summary.display = expanded, not expanded
        panel.poll()
        summary.poll()

    def toggle_cache(self) -> None:
        """F2: the full panel if the summary shows, the summary if the panel does."""
        self.cache_expanded = not self.query_one(CachePanel).display
        self.show_cache()

    def on_resize(self) -> None:
        narrow = self.app.size.width < NARROW_COLS
        if narrow != getattr(self, "_narrow", narrow):
            self.cache_expanded = None  # across the threshold the width decides again
        self._narrow = narrow
        self.show_cache()

    # -- status ------------------------------------------------------------------
    def _show_spinner(self, loading: bool) -> None:
        self.query_one("#model-spinner").display = loading
        if not loading:  # loaded (or failed): a question waiting for the model goes (or back)
            self.call_later(self.dispatch)

    def update_status(self, *_) -> None:
        # the state comes first: a narrow terminal cuts the line's end, never it
        parts = []
        if self.waiting_for_model:
            parts.append("question queued: sent when the model is loaded — Esc cancels")
        elif self.generating:
            parts.append("generating — Esc cancels")
        elif self.editing is not None:
            parts.append("editing a question — Enter resends it, Esc cancels")
        if self.json_mode:
            parts.append("JSON")
        parts.append(self.chat_app.model_status)
        if self.conversation.system_prompt:
            parts.append("system prompt set")
        if self.conversation.params:
            parts.append("own sampling (F6)")
        self.query_one("#status", Static).update(" · ".join(p for p in parts if p))

    # -- conversations -----------------------------------------------------------
    @property
    def documents(self) -> DocumentBar:
        """The attached documents (and the bar showing them)."""
        return self.query_one(DocumentBar)

    async def show_conversation(self, conversation: Conversation) -> None:
        """Replace the transcript with a (saved) conversation (documents are detached)."""
        if conversation is not self.conversation:
            self.documents.detach(quiet=True)  # they were attached to the other chat
            self.cancel_summary()
        self.conversation = conversation
        self.editing = None
        transcript = self.query_one(Transcript)
        await transcript.clear()
        if not conversation.messages:
            await transcript.show_hint(HINT)
        for m in conversation.messages:
            await transcript.add(m.role, m.content, m.meta.get("stats", ""),
                                 error=m.meta.get("finish_reason") == "error", message=m)
        if (summary := self.current_summary()) is not None:
            await transcript.mount(summary_marker(summary))
        self.chat_app.remember_chat(conversation.id if conversation.messages else None)
        self.update_status()

    def save(self) -> None:
        if not self.conversation.messages:
            return
        try:
            self.chat_app.store.save(self.conversation)
        except OSError as e:
            self.notify(f"could not save the chat: {e}", severity="error")
            return
        self.chat_app.remember_chat(self.conversation.id)

    # -- sending (`chat_send`) -------------------------------------------------------
    def new_turn(self, text: str, engine: EngineLike) -> Turn:
        """The turn for ``text`` on ``engine``, with the chat as it is now."""
        return Turn(text, engine, self.conversation.system_prompt,
                    self.conversation.history(), documents=self.documents.attached,
                    policy=self.chat_policy(), budget=self.chat_budget(engine),
                    summary=self.current_summary(), pending=self.summary_running)

    def action_cancel_generation(self) -> bool:
        """Esc: cancel the question on (see `generating`), else the edit in progress, else
        go back from a focused message to the prompt."""
        if self.cancel_turn():
            return True
        if self.editing is not None:
            self.cancel_edit()
        self.prompt_input.focus()
        return False

    @on(PromptInput.UpFromTop)
    def _up_from_prompt(self) -> None:
        self.focus_last_message()

    @on(PromptInput.LargePaste)
    def offer_paste(self, event: PromptInput.LargePaste) -> None:
        """A paste too big for a message: attach it as a document, or paste it anyway."""
        self.documents.offer_text(event.text, f"Pasted {len(event.text):,} characters",
                                  declined=lambda: event.prompt_input.insert(event.text))

    def _end_turn(self) -> None:
        self.turn = None
        self.answer = self.user_box = None
        self.query_one("#prefill").display = False
        self.refresh_bindings()
        self.update_status()
