"""The app's chat management: open, new, delete, rename, export, and the chat reopened at start.

The chat open at quit (its id) is remembered in the settings, so the next start shows
it again; a new, still empty chat forgets it.
"""

from __future__ import annotations

import contextlib

from textual.app import App

from app import settings
from app.conversations import Conversation, ConversationError, ConversationStore
from app.tui.export import ask_export
from app.tui.screens.chat import ChatScreen
from app.tui.screens.conversations import NEW, ConversationDeleted, ConversationsScreen
from app.tui.screens.dialogs import TextInputScreen


class ChatsHost(App):
    """Conversation actions of `ChatApp` (which provides ``store``, ``chat``, ``remember``)."""

    store: ConversationStore
    remember: bool
    _remembered_chat: str | None = None

    @property
    def chat(self) -> ChatScreen:
        return self.get_screen("chat")  # type: ignore[return-value]

    def initial_conversation(self, conversation_id: str | None) -> Conversation:
        """The chat to open at start: the one asked for, else the last one (remembered)."""
        if conversation_id is None and self.remember:
            conversation_id = settings.load_settings().last_conversation
            self._remembered_chat = conversation_id
            quiet = True  # a chat deleted since is no news
        else:
            quiet = False
        if conversation_id:
            try:
                return self.store.load(conversation_id)
            except ConversationError as e:
                if not quiet:
                    self.notify(str(e), severity="error")
        return self.store.new()

    def remember_chat(self, conversation_id: str | None) -> None:
        """Remember the chat on screen, to reopen it at the next start."""
        if not self.remember or conversation_id == self._remembered_chat:
            return
        self._remembered_chat = conversation_id
        with contextlib.suppress(OSError):  # only a convenience: never worth an error
            settings.save_settings(last_conversation=conversation_id)

    def _idle(self, what: str) -> bool:
        if self.chat.generating:
            self.notify(f"An answer is being written: press Esc before {what}.",
                        severity="warning")
            return False
        return True

    def action_conversations(self) -> None:
        if isinstance(self.screen, ConversationsScreen):
            return

        async def chosen(cid: str | None) -> None:
            if cid == NEW:
                await self.action_new_chat()
            elif cid is not None:
                await self.open_conversation(cid)

        self.push_screen(ConversationsScreen(self.store, current=self.chat.conversation.id),
                         chosen)

    async def open_conversation(self, conversation_id: str) -> None:
        if conversation_id == self.chat.conversation.id:
            return
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

    def on_conversations_screen_renamed(self, message: ConversationsScreen.Renamed) -> None:
        if self.chat.conversation.id == message.conversation_id:
            self.chat.conversation.title = message.title

    def action_rename_chat(self) -> None:
        """Rename the chat on screen (saved at once)."""
        conversation = self.chat.conversation
        if not conversation.messages:
            self.notify("This chat is empty: ask something first.", severity="warning")
            return

        def done(title: str | None) -> None:
            if title:
                conversation.title = title
                self.chat.save()
                self.notify(f"Renamed to {title}.", timeout=3)

        self.push_screen(TextInputScreen("Rename this chat", conversation.title), done)

    def action_export_chat(self) -> None:
        """Export the chat on screen to a Markdown file (the path can be edited)."""
        conversation = self.chat.conversation
        if not conversation.messages:
            self.notify("This chat is empty: there is nothing to export.", severity="warning")
            return
        ask_export(self, conversation)

