"""The chat screen's side of a turn: the worker's messages, from the first token to the end.

A turn enters the conversation when it ends: a cancelled answer with some text stays as
partial text (marked, and one key deletes it); a turn cancelled, rejected or failed before
any answer leaves nothing behind but its question, put back in the prompt, so the
transcript shows exactly what the model is sent next time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.screen import Screen
from textual.widgets import ProgressBar, Static

from app.conversations import Conversation
from app.tui.documents import answer_line
from app.tui.generation import (
    PrefillProgress,
    TextReceived,
    Turn,
    TurnFinished,
    TurnRejected,
    TurnStarted,
    stats_line,
)
from app.tui.model_host import model_name
from app.tui.widgets.cache_panel import CachePanel
from app.tui.widgets.document_bar import DocumentBar
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox, Transcript

PARTIAL = ("cancelled", "shutdown", "error")  # finish reasons that cut an answer short


class TurnEvents(Screen):
    """The turn's messages for `ChatScreen` (which provides the members declared here)."""

    conversation: Conversation
    turn: Turn | None
    answer: MessageBox | None
    user_box: MessageBox | None
    hint: str = ""  # shown in an empty transcript

    if TYPE_CHECKING:  # provided by ChatScreen
        @property
        def documents(self) -> DocumentBar: ...
        @property
        def chat_app(self): ...
        def save(self) -> None: ...
        def _end_turn(self) -> None: ...
        def after_answer(self) -> None: ...

    # -- the worker's messages ---------------------------------------------------
    def on_turn_started(self, message: TurnStarted) -> None:
        if message.turn is not self.turn or self.answer is None:
            return
        self.answer.set_stats("")
        self.query_one(CachePanel).context = message.turn.usage()
        if message.notice:
            self.notify(message.notice, severity="warning")
        if message.turn.dropped_turns:
            self.notify(f"The chat is longer than its budget: the oldest "
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
        if message.turn is not self.turn or self.answer is None or self.user_box is None:
            return
        turn, reason = message.turn, message.finish_reason
        cut = None
        if turn.loop_cut is not None and reason == "cancelled":  # the chat stopped a loop
            reason, cut = "loop", self.answer.raw[:turn.loop_cut]
        await self.answer.settle(cut, count=turn.engine.count_tokens)
        line = stats_line(reason, message.stats, message.error)
        if turn.dropped_turns and turn.fitted is not None:  # the cut, under the answer
            line += "\n" + turn.fitted.notes()[-1]
        if turn.documents is not None and turn.prepared is not None:
            line += "\ndoc: " + answer_line(turn.documents, turn.prepared, message.stats)
            self.documents.answered(turn.documents, turn.prepared, message.stats)
        if message.stats is not None:
            self.query_one(CachePanel).last_turn = (
                getattr(message.stats, "cached_tokens", 0), message.stats.prompt_tokens)
        if reason in PARTIAL and not (self.answer.text.strip() or self.answer.parts.calls):
            # nothing was answered: the question is not kept in the chat (the model would
            # re-read it next time) but goes back to the prompt, to send again or change
            await self._drop_turn_boxes()
            self.restore_prompt(turn.prompt)
            self.notify(f"{line.splitlines()[0]}. Nothing was answered, so the question is "
                        "not kept in the chat; it is back in the prompt.",
                        severity="error" if reason == "error" else "information", timeout=6)
            self._end_turn()
            return
        if reason in ("cancelled", "shutdown"):
            line += " · the partial answer stays in the chat (select it, d deletes the turn)"
        await self.answer.finish(line, error=reason == "error")
        self.conversation.model = model_name(self.chat_app.model_name)
        self.user_box.attach(self.conversation.add("user", turn.prompt))
        self.answer.attach(self.conversation.add("assistant", self.answer.text,
                                                 finish_reason=reason, stats=line,
                                                 **self.answer.parts_meta()))
        self.save()
        self._end_turn()
        self.after_answer()  # summarize: condense the oldest turns in the background

    async def _drop_turn_boxes(self) -> None:
        for box in (self.user_box, self.answer):
            if box is not None:
                await box.remove()
        if not self.conversation.messages:
            await self.query_one(Transcript).show_hint(self.hint)

    def restore_prompt(self, text: str) -> None:
        """Put ``text`` back in the prompt, unless the user has typed something new."""
        prompt = self.query_one(PromptInput)
        if not prompt.text.strip():
            prompt.text = text
            prompt.move_cursor(prompt.document.end)

    async def on_turn_rejected(self, message: TurnRejected) -> None:
        if message.turn is not self.turn:
            return
        await self._drop_turn_boxes()
        self.notify(message.error, title="Prompt not sent", severity="error")
        self._end_turn()
        prompt = message.turn.prompt
        if message.too_large and message.turn.documents is None:
            # attached, it is gone from the prompt; declined, it is back to be shortened
            self.documents.offer_text(prompt, f"The prompt ({len(prompt):,} characters) "
                                              "does not fit the context",
                                      declined=lambda: self.restore_prompt(prompt))
        else:
            self.restore_prompt(prompt)
