"""The chat screen: transcript, prompt, prefill bar, status line and the cache panel."""

from __future__ import annotations

from typing import Protocol, cast

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, ProgressBar, Static
from textual.worker import get_current_worker

from app.conversations import Conversation, ConversationStore
from app.engine_like import EngineLike
from app.tui.documents import answer_line, parse_doc_command
from app.tui.generation import (
    PrefillProgress,
    TextReceived,
    Turn,
    TurnFinished,
    TurnRejected,
    TurnStarted,
    stats_line,
    stream_turn,
)
from app.tui.widgets.cache_panel import CachePanel
from app.tui.widgets.document_bar import DocumentBar
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox, Transcript
from engine import SamplingParams

HINT = ("Type a message and press Enter. Ctrl+J adds a newline, Esc cancels an answer, "
        "F2 shows the KV cache, /doc FILE attaches a document, Ctrl+P lists every command.")


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


class ChatScreen(Screen):
    """One conversation with the loaded model; generation runs in a thread worker."""

    BINDINGS = [Binding("escape", "cancel_generation", "Cancel")]

    def __init__(self, conversation: Conversation):
        super().__init__()
        self.conversation = conversation
        self.turn: Turn | None = None
        self.answer: MessageBox | None = None

    @property
    def chat_app(self) -> ChatHost:
        return cast(ChatHost, self.app)

    @property
    def generating(self) -> bool:
        return self.turn is not None

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="chat-column"):
                yield Transcript(id="transcript")
                with Horizontal(id="prefill"):
                    yield Static("prefill", id="prefill-label")
                    yield ProgressBar(id="prefill-bar", show_eta=False)
                yield DocumentBar(id="doc-bar")
                yield PromptInput(id="prompt", placeholder="Ask anything…")
                with Horizontal(id="status-row"):
                    yield LoadingIndicator(id="model-spinner")
                    yield Static(id="status")
            yield CachePanel(id="cache-panel")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        self.query_one("#prefill").display = False
        await self.show_conversation(self.conversation)
        self.watch(self.app, "model_status", self.update_status)
        self.watch(self.app, "model_loading", self._show_spinner)
        self.query_one(PromptInput).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_generation":
            return self.generating
        return True

    # -- status ------------------------------------------------------------------
    def _show_spinner(self, loading: bool) -> None:
        self.query_one("#model-spinner").display = loading

    def update_status(self, *_) -> None:
        parts = [self.chat_app.model_status]
        if self.conversation.system_prompt:
            parts.append("system prompt set")
        if self.generating:
            parts.append("generating — Esc cancels")
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
        self.conversation = conversation
        transcript = self.query_one(Transcript)
        await transcript.clear()
        if not conversation.messages:
            await transcript.show_hint(HINT)
        for m in conversation.messages:
            await transcript.add(m.role, m.content, m.meta.get("stats", ""),
                                 error=m.meta.get("finish_reason") == "error")
        self.update_status()

    def save(self) -> None:
        if not self.conversation.messages:
            return
        try:
            self.chat_app.store.save(self.conversation)
        except OSError as e:
            self.notify(f"could not save the chat: {e}", severity="error")

    # -- sending -----------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def send(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if not text.strip():
            self.notify("The prompt is empty.", severity="warning")
            return
        command = parse_doc_command(text)
        if command is not None:  # not for the model: attach, pick or detach a document
            self.query_one(PromptInput).clear()
            self.documents.run(command)
            return
        if self.generating:
            self.notify("An answer is still being written: Esc cancels it.", severity="warning")
            return
        engine = self.chat_app.engine
        if engine is None:
            self.notify("No model is loaded yet.", severity="warning")
            return
        self.query_one(PromptInput).clear()
        transcript = self.query_one(Transcript)
        for hint in transcript.query(".hint"):
            await hint.remove()
        self.user_box = await transcript.add("user", text)
        self.answer = await transcript.add("assistant")
        self.answer.set_stats("waiting for the model…")
        self.turn = Turn(text, engine, self.conversation.system_prompt,
                         self.conversation.history(), documents=self.documents.attached)
        self.refresh_bindings()
        self.update_status()
        self.run_turn(self.turn)

    @work(thread=True, exclusive=True, group="generation", exit_on_error=False)
    def run_turn(self, turn: Turn) -> None:
        worker = get_current_worker()
        try:
            stream_turn(turn, self.chat_app.sampling(), self.post_message,
                        lambda: worker.is_cancelled)
        except Exception as e:  # an engine bug must not leave the chat stuck "generating"
            self.post_message(TurnFinished(turn, "error", None, f"{type(e).__name__}: {e}"))

    def action_cancel_generation(self) -> bool:
        """Cancel the running answer (the engine stops within one step)."""
        turn = self.turn
        if turn is None:
            return False
        turn.cancel_requested = True
        if turn.request_id is not None:
            turn.engine.cancel(turn.request_id)
        if self.answer is not None:
            self.answer.set_stats("cancelling…")
        return True

    # -- the worker's messages ---------------------------------------------------
    def on_turn_started(self, message: TurnStarted) -> None:
        if message.turn is not self.turn or self.answer is None:
            return
        self.answer.set_stats("")
        if message.notice:
            self.notify(message.notice, severity="warning")
        if message.turn.dropped_turns:
            self.notify(f"The chat is longer than the context: the oldest "
                        f"{message.turn.dropped_turns} turn(s) were left out.")

    def on_prefill_progress(self, message: PrefillProgress) -> None:
        if message.turn is not self.turn or message.total <= 0:
            return
        self.query_one("#prefill").display = message.done < message.total
        self.query_one("#prefill-label", Static).update(
            f"prefill {message.done:,}/{message.total:,} tokens")
        self.query_one(ProgressBar).update(total=message.total, progress=message.done)

    async def on_text_received(self, message: TextReceived) -> None:
        if message.turn is not self.turn or self.answer is None:
            return
        self.query_one("#prefill").display = False
        await self.answer.append(message.text)

    async def on_turn_finished(self, message: TurnFinished) -> None:
        if message.turn is not self.turn or self.answer is None:
            return
        turn = message.turn
        line = stats_line(message.finish_reason, message.stats, message.error)
        if turn.documents is not None and turn.prepared is not None:
            line += "\ndoc: " + answer_line(turn.documents, turn.prepared, message.stats)
            self.documents.answered(turn.documents, turn.prepared, message.stats)
        await self.answer.finish(line, error=message.finish_reason == "error")
        if message.stats is not None:
            self.query_one(CachePanel).last_turn = (
                getattr(message.stats, "cached_tokens", 0), message.stats.prompt_tokens)
        self.conversation.model = self.chat_app.model_name
        self.conversation.add("user", message.turn.prompt)
        self.conversation.add("assistant", self.answer.text,
                              finish_reason=message.finish_reason, stats=line)
        self.save()
        self._end_turn()

    async def on_turn_rejected(self, message: TurnRejected) -> None:
        if message.turn is not self.turn:
            return
        if self.answer is not None:
            await self.answer.remove()
        self.user_box.set_stats(f"not sent: {message.error}", error=True)
        self.notify(message.error, title="Prompt not sent", severity="error")
        self._end_turn()
        prompt = message.turn.prompt
        if message.too_large and message.turn.documents is None:
            self.documents.offer_text(prompt, f"The prompt ({len(prompt):,} characters) "
                                              "does not fit the context")

    @on(PromptInput.LargePaste)
    def offer_paste(self, event: PromptInput.LargePaste) -> None:
        """A paste too big for a message: attach it as a document, or paste it anyway."""
        self.documents.offer_text(event.text, f"Pasted {len(event.text):,} characters",
                                  declined=lambda: event.prompt_input.insert(event.text))

    def _end_turn(self) -> None:
        self.turn = None
        self.answer = None
        self.query_one("#prefill").display = False
        self.refresh_bindings()
        self.update_status()
