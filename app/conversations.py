"""Saved chats: one JSON file per conversation under the kvchat cache directory.

Files live in ``cache_root()/"conversations"`` (directory 0700, files 0600) and
are written atomically (temp file, fsync, rename), so a crash mid-save never
leaves a half-written chat. A corrupt or foreign file is skipped by `list` and
reported by `load`; it never takes the app down.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.cells import cell_len, set_cell_size

from engine.errors import KVChatError
from engine.paths import cache_root, private_dir, write_private

FORMAT_VERSION = 1
TITLE_CELLS = 60  # terminal cells, not characters: a CJK character or an emoji takes two
_ID_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{6}$")


class ConversationError(KVChatError):
    """A conversation is missing, unreadable or not one of ours."""


@dataclass(slots=True)
class ChatMessage:
    """One turn of a chat. ``meta`` holds what the UI shows under an answer."""

    role: str  # "user" or "assistant"
    content: str
    meta: dict = field(default_factory=dict)  # finish_reason, stats line, ...


@dataclass(slots=True)
class Conversation:
    """A chat: its messages, the system prompt it runs under and the model it used."""

    id: str
    title: str = ""
    system_prompt: str = ""
    model: str | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    params: dict = field(default_factory=dict)
    """This chat's generation settings (`app.settings.GENERATION_KEYS`); unset: the defaults."""
    summary: dict | None = None
    """The model's summary of the oldest turns (`app.context_policy.Summary`); the turns
    themselves stay in ``messages``."""

    def add(self, role: str, content: str, **meta) -> ChatMessage:
        message = ChatMessage(role, content, dict(meta))
        self.messages.append(message)
        if not self.title and role == "user":
            self.title = make_title(content)
        self.updated = time.time()
        return message

    def history(self) -> list[dict]:
        """The turns as chat-template messages (role and content only)."""
        return [{"role": m.role, "content": m.content} for m in self.messages if m.content]

    def turn_span(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of the turn holding message ``index``: a question and its answer."""
        start = index
        if self.messages[index].role == "assistant" and index > 0 \
                and self.messages[index - 1].role == "user":
            start = index - 1
        end = start + 1
        if end < len(self.messages) and self.messages[end].role == "assistant" \
                and self.messages[start].role == "user":
            end += 1
        return start, end

    def delete_turn(self, index: int) -> list[ChatMessage]:
        """Remove the turn holding message ``index``; return the removed messages."""
        start, end = self.turn_span(index)
        return self.truncate(start, end)

    def truncate(self, start: int, end: int | None = None) -> list[ChatMessage]:
        """Remove messages ``[start, end)`` (to the end by default); return them."""
        removed = self.messages[start:end]
        del self.messages[start:end]
        if self.summary is not None and start < int(self.summary.get("messages", 0)):
            self.summary = None  # it stood for turns that changed
        self.updated = time.time()
        return removed

    def matches(self, query: str) -> bool:
        """Whether every word of ``query`` is in the title or a message (any case)."""
        haystack = "\n".join([self.title, *(m.content for m in self.messages)]).casefold()
        return all(word in haystack for word in query.casefold().split())

    def to_markdown(self) -> str:
        """The chat as a Markdown document: title, system prompt, then each turn."""
        lines = [f"# {self.title or 'Untitled chat'}", ""]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.updated))
        lines += [f"*kvchat · {self.model or 'no model'} · {when}*", ""]
        if self.system_prompt:
            lines += ["**System prompt:**", "", *quote(self.system_prompt), ""]
        if self.summary:
            lines += [f"**Summary of turns 1–{(self.summary['messages'] + 1) // 2}** "
                      "(what the model is sent instead of them):", "",
                      *quote(self.summary["text"]), ""]
        for m in self.messages:
            lines += [f"## {'You' if m.role == 'user' else 'Assistant'}", "", m.content, ""]
            reason = m.meta.get("finish_reason")
            if reason in ("cancelled", "shutdown", "error"):
                lines += [f"*({reason}: partial answer)*", ""]
        return "\n".join(lines).rstrip() + "\n"

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Conversation:
        if data.get("version") != FORMAT_VERSION:
            raise ConversationError(f"unknown conversation format {data.get('version')!r}")
        messages = [ChatMessage(m["role"], m["content"], dict(m.get("meta") or {}))
                    for m in data.get("messages", [])]
        return cls(id=data["id"], title=data.get("title", ""),
                   system_prompt=data.get("system_prompt", ""), model=data.get("model"),
                   messages=messages, created=float(data.get("created", 0.0)),
                   updated=float(data.get("updated", 0.0)),
                   params=dict(data.get("params") or {}),
                   summary=data.get("summary") or None)


@dataclass(slots=True)
class ConversationSummary:
    """What the conversation list shows, without the messages."""

    id: str
    title: str
    model: str | None
    num_messages: int
    updated: float


def quote(text: str) -> list[str]:
    """``text`` as Markdown block-quote lines."""
    return ["> " + line if line else ">" for line in text.splitlines()]


def make_title(text: str) -> str:
    """A chat's title from its first question: one line of at most `TITLE_CELLS` cells."""
    return fit_cells(" ".join(text.split()), TITLE_CELLS)


def fit_cells(text: str, width: int) -> str:
    """``text`` cut to ``width`` terminal cells, ending in "…" when cut (wide chars count 2)."""
    if cell_len(text) <= width:
        return text
    return set_cell_size(text, width - 1).rstrip() + "…"


def new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class ConversationStore:
    """New, list, load, save and delete conversations in one directory."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else cache_root() / "conversations"

    def _path(self, conversation_id: str) -> Path:
        if not _ID_RE.match(conversation_id):
            raise ConversationError(f"not a conversation id: {conversation_id!r}")
        return self.root / f"{conversation_id}.json"

    def new(self, *, system_prompt: str = "", model: str | None = None) -> Conversation:
        """A fresh conversation; it is written on the first `save`."""
        return Conversation(id=new_id(), system_prompt=system_prompt, model=model)

    def save(self, conversation: Conversation) -> Path:
        """Write atomically and privately (0600): temp file in the same directory, fsync, rename."""
        path = self._path(conversation.id)
        data = json.dumps(conversation.to_dict(), ensure_ascii=False, indent=1)
        private_dir(self.root)
        return write_private(path, data.encode("utf-8"))

    def load(self, conversation_id: str) -> Conversation:
        path = self._path(conversation_id)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return Conversation.from_dict(data)
        except FileNotFoundError as e:
            raise ConversationError(f"no saved conversation {conversation_id}") from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversationError(f"cannot read conversation {conversation_id}: {e}") from e

    def list(self, query: str = "") -> list[ConversationSummary]:
        """Saved conversations, most recently updated first; unreadable files are skipped.

        ``query``: only the chats whose title or text holds each of its words (any case).
        """
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.glob("*.json"):
            if not _ID_RE.match(path.stem):
                continue
            try:
                conv = self.load(path.stem)
            except ConversationError:
                continue
            if query and not conv.matches(query):
                continue
            out.append(ConversationSummary(conv.id, conv.title or "(untitled)", conv.model,
                                           len(conv.messages), conv.updated))
        out.sort(key=lambda s: s.updated, reverse=True)
        return out

    def delete(self, conversation_id: str) -> bool:
        try:
            self._path(conversation_id).unlink()
        except FileNotFoundError:
            return False
        return True
