"""The chat screen's summaries: started after an answer, shown in the transcript, saved.

Under the ``summarize`` context policy (`app.context_policy`), a conversation past its
budget has its oldest turns condensed by the model: a background-priority request
started right after an answer, so the next question rarely waits (it waits only when,
without the summary, turns would be left out). The summary is saved with the chat (the
turns stay too) and shown as a collapsible line, "turns 1–6 summarized (1,412 → 180
tokens)", that opens on the summary's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual import work
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Collapsible, Static

from app.context_policy import Summary, default_chat_budget
from app.context_summary import SummaryJob, summary_job
from app.conversations import Conversation
from app.tui.widgets.transcript import Transcript


@dataclass
class SummaryReady(Message):
    """A summary job ended (``job.result`` None: cancelled or failed, ``job.error``)."""

    job: SummaryJob
    conversation: Conversation


def summary_marker(summary: Summary) -> Collapsible:
    """The transcript's line for a summary; it opens on the summary's text."""
    return Collapsible(Static(summary.text), title=summary.label(), collapsed=True,
                       classes="summary-marker")


class SummaryEvents(Screen):
    """Summaries for `ChatScreen` (which provides the members declared here)."""

    conversation: Conversation
    summary_running: SummaryJob | None = None

    if TYPE_CHECKING:  # provided by ChatScreen
        @property
        def chat_app(self): ...
        def save(self) -> None: ...

    def chat_budget(self, engine) -> int:
        return getattr(self.chat_app, "context_budget", None) or default_chat_budget(
            engine.max_context)

    def chat_policy(self) -> str:
        return getattr(self.chat_app, "context_policy", "summarize")

    def current_summary(self) -> Summary | None:
        return Summary.from_dict(self.conversation.summary)

    def after_answer(self) -> None:
        """Start a summary when the conversation has outgrown its budget's trigger."""
        engine = self.chat_app.engine
        if (engine is None or self.chat_policy() != "summarize"
                or (self.summary_running is not None and not self.summary_running.done)):
            return
        job = summary_job(engine, self.conversation.history(), self.current_summary(),
                          budget=self.chat_budget(engine),
                          system=self.conversation.system_prompt)
        if job is not None:
            self.summary_running = job
            self.run_summary(job, self.conversation)

    @work(thread=True, group="summary", exit_on_error=False)
    def run_summary(self, job: SummaryJob, conversation: Conversation) -> None:
        job.run()
        self.post_message(SummaryReady(job, conversation))

    def cancel_summary(self) -> None:
        """Stop a summary being written (the chat changed or closes)."""
        if self.summary_running is not None:
            self.summary_running.cancel()
            self.summary_running = None

    async def on_summary_ready(self, message: SummaryReady) -> None:
        job, summary = message.job, message.job.result
        if job is self.summary_running:
            self.summary_running = None
        history = message.conversation.history()
        if (message.conversation is not self.conversation or summary is None
                or history[:job.upto] != job.history[:job.upto]):
            if summary is None and job.error and message.conversation is self.conversation:
                self.notify(f"The summary of older turns failed ({job.error}); they will be "
                            "left out when the chat outgrows its budget.", severity="warning")
            return  # another chat, or its turns were edited meanwhile
        self.conversation.summary = summary.to_dict()
        self.save()
        await self.query_one(Transcript).mount(summary_marker(summary))
        self.query_one(Transcript).anchor()
