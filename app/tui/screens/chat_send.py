"""Sending a question: from Enter to a worker writing its answer, with no gap a key can fall in.

A question counts as running from the moment the chat hears of it: while its Enter is
still on its way (`PromptInput.submits_in_flight`), while its boxes are being mounted,
while it waits for a model that is loading (it is sent once the model is in), and while
its answer is written. Esc or Ctrl+C in any of these cancels it; a question cancelled
before it reached the engine goes back to the prompt. Quitting waits for the screen to
settle (`settle`), so nothing queries a widget after the screen is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual import on, work
from textual.screen import Screen
from textual.worker import get_current_worker

from app.tui.documents import parse_doc_command
from app.tui.generation import Turn, TurnFinished, stream_turn
from app.tui.widgets.cache_panel import CachePanel
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox, Transcript
from engine import Constraint

WAITING_FOR_LOAD = "the model is loading: this question is sent when it is ready · Esc cancels"
LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")
JSON_SYSTEM = "Answer with one JSON object."
JSON_COMMAND = re.compile(r"/json(?:\s+(\S.*))?", re.DOTALL)


def parse_json_command(text: str) -> bool | str | None:
    """``/json`` (or ``/json on``): True; ``/json off``: False; another argument: it, to
    be refused; None: not the command (a message for the model)."""
    m = JSON_COMMAND.fullmatch(text.strip())
    if m is None:
        return None
    arg = (m.group(1) or "on").strip().lower()
    return {"on": True, "off": False}.get(arg, arg)


@dataclass(eq=False)
class Pending:
    """A question sent and not yet handed to the engine (shown, or waiting for a model)."""

    prompt: str
    cancelled: bool = False


class TurnStart(Screen):
    """Sending for `ChatScreen` (which provides the members declared here)."""

    turn: Turn | None
    answer: MessageBox | None
    user_box: MessageBox | None
    pending: Pending | None = None
    mounting: int = 0  # a question's boxes being mounted or removed (awaited)
    cancelled_submits: int = 0  # Enters cancelled before their `Submitted` arrived
    json_mode: bool = False  # /json: answers are decoded as JSON objects until /json off

    if TYPE_CHECKING:  # provided by ChatScreen and its other mixins
        @property
        def chat_app(self): ...
        @property
        def documents(self): ...
        @property
        def prompt_input(self) -> PromptInput: ...
        def new_turn(self, text: str, engine) -> Turn: ...
        def update_status(self, *_) -> None: ...
        def _end_turn(self) -> None: ...
        async def end_edit(self) -> bool: ...
        async def remove_messages(self, start: int, end: int | None = None) -> None: ...
        async def _drop_turn_boxes(self) -> None: ...
        def restore_prompt(self, text: str) -> None: ...

    @property
    def generating(self) -> bool:
        """A question is on: on its way, being shown, waiting for the model, or answered."""
        return (self.turn is not None or self.pending is not None
                or self.prompt_input.submits_in_flight > self.cancelled_submits)

    @property
    def waiting_for_model(self) -> bool:
        return self.pending is not None and self.chat_app.engine is None

    @property
    def settled(self) -> bool:
        return self.turn is None and self.pending is None and not self.mounting

    @on(PromptInput.Submitted)
    async def send(self, event: PromptInput.Submitted) -> None:
        event.prompt_input.submits_in_flight -= 1
        if self.cancelled_submits:  # Esc or Ctrl+C came after this Enter, before it got here
            self.cancelled_submits -= 1
            self.notify("Cancelled before it was sent: the question is still in the prompt.",
                        timeout=3)
            return
        text = LEADING_BLANK_LINES.sub("", event.text)
        if not text.strip():
            self.notify("The prompt is empty.", severity="warning")
            return
        command = parse_doc_command(text)
        if command is not None:  # not for the model: attach, pick or detach a document
            self.prompt_input.clear()
            self.documents.run(command)
            return
        json_command = parse_json_command(text)
        if json_command is not None:
            if isinstance(json_command, str):
                self.notify("/json turns JSON answers on, /json off turns them off.",
                            severity="warning")
                return
            self.prompt_input.clear()
            self.set_json_mode(json_command)
            return
        if self.turn is not None or self.pending is not None:
            self.notify("An answer is still being written: Esc cancels it.", severity="warning")
            return
        if self.chat_app.engine is None and not self.app.model_loading:  # type: ignore[attr-defined]
            self.notify("No model is loaded: F3 picks one.", severity="warning")
            return
        await self.start_turn(text)

    async def start_turn(self, text: str, *, drop_from: int | None = None) -> None:
        """Show the question and have it answered (now, or once the model is loaded).

        ``drop_from``: the messages from there go first (a retry); otherwise a question
        being edited is replaced, with the turns after it.
        """
        self.pending = Pending(text)  # running from here on: Ctrl+C cancels, quit waits
        self.refresh_bindings()
        self.update_status()
        self.mounting += 1
        try:
            if drop_from is not None:
                await self.remove_messages(drop_from)
            else:
                await self.end_edit()
            self.prompt_input.clear()
            transcript = self.query_one(Transcript)
            for hint in transcript.query(".hint"):
                await hint.remove()
            self.user_box = await transcript.add("user", text)
            self.answer = await transcript.add("assistant")
            self.answer.set_stats("waiting for the model…")
        finally:
            self.mounting -= 1
        await self.dispatch()

    async def dispatch(self) -> None:
        """Hand the shown question to a worker once a model is in; or drop it (cancelled,
        quitting, or no model after all) and put it back in the prompt."""
        pending = self.pending
        if pending is None or self.mounting:
            return  # nothing to send, or the mount's end sends it
        engine = self.chat_app.engine
        closing = getattr(self.app, "closing", False)
        loading = self.app.model_loading  # type: ignore[attr-defined]
        if engine is None and loading and not (pending.cancelled or closing):
            if self.answer is not None:
                self.answer.set_stats(WAITING_FOR_LOAD)
            self.update_status()
            return
        self.pending = None
        if pending.cancelled or closing or engine is None:
            why = ("Cancelled before it was sent" if pending.cancelled or closing
                   else "No model could be loaded (F3 picks one)")
            self.mounting += 1  # the screen is not settled until its boxes are gone
            try:
                await self._drop_turn_boxes()
            finally:
                self.mounting -= 1
            self.restore_prompt(pending.prompt)
            self.notify(f"{why}: the question is back in the prompt.", timeout=4)
            self._end_turn()
            return
        self.turn = self.new_turn(pending.prompt, engine)
        if self.json_mode:  # said too, as OpenAI asks: a small model forced into JSON alone
            self.turn.json = True  # rambles inside a key until max tokens cut it
            self.turn.system = "\n\n".join(filter(None, (self.turn.system, JSON_SYSTEM)))
        self.query_one(CachePanel).last_turn = None  # this turn's line comes when it ends
        if self.answer is not None:
            self.answer.set_stats("waiting for the model…")
            self.answer.json_answer = self.turn.json
        self.refresh_bindings()
        self.update_status()
        self.run_turn(self.turn)

    @work(thread=True, exclusive=True, group="generation", exit_on_error=False)
    def run_turn(self, turn: Turn) -> None:
        worker = get_current_worker()
        try:
            params = self.chat_app.sampling()
            if turn.json:  # the engine's constrained decoder: a JSON object, or a length cut
                params = dataclasses.replace(params, constraint=Constraint("json_object"))
            stream_turn(turn, params, self.post_message, lambda: worker.is_cancelled)
        except Exception as e:  # an engine bug must not leave the chat stuck "generating"
            self.post_message(TurnFinished(turn, "error", None, f"{type(e).__name__}: {e}"))

    def set_json_mode(self, on: bool) -> None:
        """/json, /json off: the next questions are answered in JSON, or in text again."""
        self.json_mode = on
        self.update_status()
        self.notify("JSON answers: each answer is one JSON object (the engine's constrained "
                    "decoding) until /json off." if on else "JSON answers off.", timeout=4)

    def cancel_turn(self) -> bool:
        """Cancel whatever question is on (see `generating`); False when none is, or it is
        being cancelled already (then Ctrl+C quits: nothing is left to cancel)."""
        if self.pending is not None:
            if self.pending.cancelled:
                return False
            self.pending.cancelled = True
            if self.answer is not None:
                self.answer.set_stats("cancelling…")
            self.call_later(self.dispatch)
            return True
        turn = self.turn
        if turn is None:
            in_flight = self.prompt_input.submits_in_flight
            if in_flight > self.cancelled_submits:
                self.cancelled_submits = in_flight
                return True
            return False
        if turn.cancel_requested:
            return False
        turn.cancel_requested = True
        if turn.request_id is not None:
            turn.engine.cancel(turn.request_id)
        if self.answer is not None:
            self.answer.set_stats("cancelling…")
        return True

    async def settle(self, timeout: float) -> None:
        """Wait until no question is on (quitting: the engine has stopped, so a running
        answer ends as "shutdown"; a question not yet sent is dropped)."""
        await self.dispatch()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not self.settled and loop.time() < end:
            await asyncio.sleep(0.02)
