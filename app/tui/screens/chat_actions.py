"""What can be done with one message of the chat: copy, retry, edit and resend, delete.

The chat screen mixes this in. A message box posts `MessageBox.Act`; the conversation
and the transcript change together here, so the transcript keeps showing exactly the
messages the model will be sent next time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.screen import Screen

from app.conversations import ChatMessage, Conversation
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox, Transcript


class MessageActions(Screen):
    """Message actions for `ChatScreen` (which provides the members declared here)."""

    conversation: Conversation
    editing: ChatMessage | None  # the question being edited; sending replaces it

    if TYPE_CHECKING:  # provided by ChatScreen
        @property
        def generating(self) -> bool: ...
        def save(self) -> None: ...
        def update_status(self, *_) -> None: ...
        async def start_turn(self, text: str, *, drop_from: int | None = None) -> None: ...

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    def index_of(self, box: MessageBox) -> int | None:
        """The conversation index of ``box``'s message; None while its turn runs."""
        return next((i for i, m in enumerate(self.conversation.messages)
                     if m is box.message), None) if box.message is not None else None

    def focus_last_message(self) -> None:
        """Focus the newest message (↑ from the prompt's first line)."""
        boxes = self.transcript.boxes
        if boxes:
            boxes[-1].focus()

    async def on_message_box_act(self, event: MessageBox.Act) -> None:
        event.stop()
        box, action = event.box, event.action
        if action in ("previous", "next"):
            self._move(box, -1 if action == "previous" else 1)
        elif action == "copy":
            text = box.copy_text
            self.app.copy_to_clipboard(text)
            what = "question" if box.role == "user" else "answer"
            self.notify(f"Copied the {what} ({len(text):,} characters).", timeout=2)
        elif self._busy(action):
            return
        elif action == "retry":
            await self.retry(box)
        elif action == "edit":
            self.edit(box)
        elif action == "delete":
            await self.delete_turn(box)

    def _move(self, box: MessageBox, step: int) -> None:
        boxes = self.transcript.boxes
        i = boxes.index(box) + step
        if i >= len(boxes):
            self.query_one(PromptInput).focus()
        elif i >= 0:
            boxes[i].focus()

    def _busy(self, action: str) -> bool:
        if self.generating:
            self.notify(f"An answer is being written: Esc cancels it, then {action}.",
                        severity="warning")
            return True
        return False

    async def remove_messages(self, start: int, end: int | None = None) -> None:
        """Drop messages ``[start, end)`` from the conversation and their boxes; save."""
        removed = self.conversation.truncate(start, end)
        for box in self.transcript.boxes:
            if any(box.message is m for m in removed):
                await box.remove()
        if self.editing is not None and any(self.editing is m for m in removed):
            self.editing = None
        if self.conversation.messages:
            self.save()
        else:  # nothing left to save: the empty chat is not kept either
            self.app.store.delete(self.conversation.id)  # type: ignore[attr-defined]

    async def retry(self, box: MessageBox) -> None:
        """Ask the last question again: its answer is dropped and a new one written."""
        index = self.index_of(box)
        if box.role != "assistant" or index is None:
            return
        if index != len(self.conversation.messages) - 1:
            self.notify("Only the last answer can be retried; e on an earlier question "
                        "edits and resends it.", severity="warning")
            return
        start, _ = self.conversation.turn_span(index)
        question = self.conversation.messages[start]
        if question.role != "user":
            return
        self.query_one(PromptInput).focus()
        await self.start_turn(question.content, drop_from=start)  # running from the start

    def edit(self, box: MessageBox) -> None:
        """Put a question back in the prompt; sending it drops it and every later turn."""
        if box.role != "user" or box.message is None:
            return
        self.editing = box.message
        prompt = self.query_one(PromptInput)
        prompt.text = box.text
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        self.update_status()
        self.notify("Editing the question: Enter resends it (the turns after it are "
                    "dropped), Esc keeps the chat as it is.", timeout=4)

    async def delete_turn(self, box: MessageBox) -> None:
        """Delete the question and answer ``box`` belongs to: the model no longer sees them."""
        index = self.index_of(box)
        if index is None:
            return
        boxes = self.transcript.boxes
        start, end = self.conversation.turn_span(index)
        after = boxes[boxes.index(box) + (end - index):]  # the first box after the turn
        # the focus moves first: removing the focused box would hand it to the box before,
        # scrolled to its middle (the last turn deleted left the chat there, issue 32)
        (after[0] if after else self.query_one(PromptInput)).focus()
        await self.remove_messages(start, end)
        if not after:  # back to the newest message
            self.transcript.call_after_refresh(self.transcript.anchor)
        self.notify("Deleted the turn: the model will not see it again.", timeout=3)

    async def end_edit(self) -> bool:
        """Resend an edited question: drop it and the later turns. False: no edit."""
        if self.editing is None:
            return False
        index = next((i for i, m in enumerate(self.conversation.messages)
                      if m is self.editing), None)
        self.editing = None
        if index is not None:
            await self.remove_messages(index)
        return True

    def cancel_edit(self) -> None:
        """Esc while editing: the chat stays as it was, the prompt is emptied."""
        self.editing = None
        self.query_one(PromptInput).clear()
        self.update_status()
