"""Documents in the chat on the scripted engine: /doc, the picker, bad files, detach, pastes.

The real-model check (the second question reuses the document's cached prefix) is
`test_tui.py::test_document_prefix_is_cached_for_the_next_question`.
"""

from __future__ import annotations

import pytest
from pdf_maker import make_pdf
from test_tui_app import SIZE, ask, boxes, make_app, wait_for
from test_tui_fakes import FakeEngine
from textual import events

from app.documents.sessions import DEFAULT_SESSION_TTL_S
from app.tui.documents import DocCommand, parse_doc_command
from app.tui.screens.dialogs import ConfirmScreen
from app.tui.screens.document_picker import DocumentPicker
from app.tui.widgets.document_bar import DocumentBar
from app.tui.widgets.prompt_input import LARGE_PASTE_CHARS, PromptInput

NOTES = "The launch code is AZURE-7.\n\nThe backup site is in Tromsø.\n"


@pytest.fixture
def store(tmp_path):
    from app.conversations import ConversationStore

    return ConversationStore(tmp_path / "conversations")


def stats_of(box) -> str:
    return str(box.query_one(".stats").render())


def bar_of(app) -> DocumentBar:
    return app.chat.query_one(DocumentBar)


def bar_text(app) -> str:
    return str(bar_of(app).render())


async def command(pilot, app, text: str) -> None:
    """Type a /doc line: it never reaches the model."""
    app.chat.query_one(PromptInput).text = text
    await pilot.press("enter")
    await pilot.pause()


async def attached(pilot, app, path, engine: FakeEngine) -> None:
    await wait_for(pilot, lambda: app.engine is not None)
    await command(pilot, app, f"/doc {path}")
    await wait_for(pilot, lambda: bar_of(app).attached is not None)


@pytest.mark.parametrize(("text", "expected"), [
    ("/doc", DocCommand("pick")),
    ("  /doc  \n", DocCommand("pick")),
    ("/doc off", DocCommand("detach")),
    ("/doc NONE", DocCommand("detach")),
    ("/doc notes.md", DocCommand("attach", "notes.md")),
    ("/doc 'my notes.md'", DocCommand("attach", "my notes.md")),
    ("/doc my\\ notes.md", DocCommand("attach", "my notes.md")),
    ("/document", None),
    ("what does /doc do?", None),
])
def test_parse_doc_command(text, expected):
    assert parse_doc_command(text) == expected


def test_a_path_that_exists_is_taken_as_typed(tmp_path):
    odd = tmp_path / "it's here.txt"
    odd.write_text("x")
    assert parse_doc_command(f"/doc {odd}") == DocCommand("attach", str(odd))


async def test_doc_attaches_and_questions_go_with_it(store, tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text(NOTES)
    engine = FakeEngine("AZURE-7.")
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot, app, doc, engine)
        assert not boxes(app)  # the command is not a message
        assert bar_of(app).display
        assert bar_text(app).startswith("doc: notes.md · 11 tokens · sent with every")
        assert any("Attached notes.md (11 tokens)" in n for n in app.notices)
        await ask(pilot, app, "What is the launch code?")
        await ask(pilot, app, "And the backup site?")
        document, question, system = engine.pinned[-1]
        assert NOTES.strip() in document and question == "And the backup site?"
        assert engine.histories[-1] == [
            {"role": "user", "content": "What is the launch code?"},
            {"role": "assistant", "content": "AZURE-7."}]
        # the pinned prefix is kept on disk for a document session's lifetime
        assert [k["cache_ttl_s"] for k in engine.submit_kwargs] == [DEFAULT_SESSION_TTL_S] * 2
        line = stats_of(boxes(app)[3])
        assert "doc: documents placed whole (" in line and "nothing left out" in line
        assert "tokens from cache (memory)" in line and "for documents" in line
        assert "· whole · prefix" in bar_text(app) and "(memory)" in bar_text(app)
    saved = store.load(store.list()[0].id)
    assert "doc: documents placed whole" in saved.messages[3].meta["stats"]


async def test_a_document_too_big_for_the_budget_reports_what_was_left_out(store, tmp_path):
    # the fake's pool holds 84 free blocks of 16 tokens: 1,344 tokens for everything
    doc = tmp_path / "big.txt"
    doc.write_text("\n\n".join(f"Section {i}: " + "filler words here " * 40 + f"marker{i}."
                               for i in range(20)))
    engine = FakeEngine("ok")
    app = make_app(store, engine, max_tokens=32)
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot, app, doc, engine)
        await ask(pilot, app, "What is marker7?")
        line = stats_of(boxes(app)[1])
        assert "retrieval:" in line and "left out big.txt:" in line, line
        assert "marker7" in engine.pinned[-1][0]
        assert engine.submit_kwargs[-1]["cache_ttl_s"] is None  # no pinned prefix
        assert "tokens left out" in bar_text(app)


@pytest.mark.parametrize(("name", "data", "message"), [
    ("missing.txt", None, "cannot read"),
    ("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary file"),
    ("empty.txt", b"", "is empty"),
    ("scan.pdf", make_pdf(["", ""]), "no text layer"),
])
async def test_bad_documents_show_one_line_and_the_chat_goes_on(store, tmp_path, name, data,
                                                                message):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    engine = FakeEngine()
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await command(pilot, app, f"/doc {path}")
        await wait_for(pilot, lambda: any(message in n for n in app.notices))
        [notice] = [n for n in app.notices if message in n]
        assert "\n" not in notice
        assert bar_of(app).attached is None and not bar_of(app).display
        await ask(pilot, app, "Still there?")
        assert boxes(app)[1].text and not engine.pinned  # an ordinary question


async def test_detach_and_a_new_chat_leave_the_document(store, tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text(NOTES)
    engine = FakeEngine()
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot, app, doc, engine)
        await command(pilot, app, "/doc off")
        assert bar_of(app).attached is None and not bar_of(app).display
        assert "Detached notes.md." in app.notices
        await ask(pilot, app, "hello")
        assert not engine.pinned
        await command(pilot, app, "/doc off")
        assert "No document is attached." in app.notices
        # attached again, then a new chat: the document belonged to the old one
        await command(pilot, app, f"/doc {doc}")
        await wait_for(pilot, lambda: bar_of(app).attached is not None)
        await command(pilot, app, f"/doc {doc}")
        await wait_for(pilot, lambda: "notes.md is already attached." in app.notices)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: bar_of(app).attached is None)


async def test_two_documents_and_the_palette_picker(store, tmp_path, monkeypatch):
    (tmp_path / "a.md").write_text("Alpha is first.")
    (tmp_path / "b.txt").write_text("Beta is second.")
    (tmp_path / ".hidden.txt").write_text("never listed")
    monkeypatch.chdir(tmp_path)
    engine = FakeEngine()
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot, app, "a.md", engine)
        await app.run_action("attach_document")  # what the palette's entry runs
        await wait_for(pilot, lambda: isinstance(app.screen, DocumentPicker)
                       and app.screen.query("#picker-tree"))
        tree = app.screen.query_one("#picker-tree")
        await wait_for(pilot, lambda: tree.root.children)
        assert [str(n.label) for n in tree.root.children] == ["a.md", "b.txt"]
        await pilot.press("down", "down", "enter")  # root, a.md, b.txt
        await wait_for(pilot, lambda: bar_of(app).attached is not None
                       and len(bar_of(app).attached.docs) == 2)
        assert app.screen is app.chat
        assert bar_text(app).startswith("doc: a.md, b.txt · 6 tokens")
        await ask(pilot, app, "Which is first?")
        assert "Alpha" in engine.pinned[-1][0] and "Beta" in engine.pinned[-1][0]
        await command(pilot, app, "/doc")  # the picker again; Esc leaves it
        await wait_for(pilot, lambda: isinstance(app.screen, DocumentPicker))
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)
        await app.run_action("detach_document")
        assert bar_of(app).attached is None


async def paste(pilot, app, text: str) -> None:
    """A bracketed paste, as the terminal driver delivers it: to the app, which forwards it
    to the focused widget."""
    app.chat.query_one(PromptInput).focus()
    app.post_message(events.Paste(text))
    await pilot.pause()


async def test_a_large_paste_is_offered_as_a_document(store):
    engine = FakeEngine()
    app = make_app(store, engine)
    big = "Clause 12 says the fee is 40 euros. " * 1200  # 43,200 characters
    assert len(big) >= LARGE_PASTE_CHARS
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt = app.chat.query_one(PromptInput)
        await paste(pilot, app, "a small paste")
        assert prompt.text == "a small paste"  # inserted as usual
        prompt.clear()
        await paste(pilot, app, big)
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "Pasted 43,200 characters: attach it as a document?" in app.screen.question
        await pilot.press("enter")  # yes
        await wait_for(pilot, lambda: bar_of(app).attached is not None)
        assert prompt.text == ""
        assert bar_text(app).startswith("doc: pasted text · 9,600 tokens")
        await command(pilot, app, "/doc off")
        # no: the paste goes into the prompt after all
        await paste(pilot, app, big)
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert prompt.text == big and bar_of(app).attached is None


async def test_a_prompt_too_long_for_the_context_is_offered_as_a_document(store):
    engine = FakeEngine(max_prompt_tokens=50)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await ask(pilot, app, "word " * 500)
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "does not fit the context" in app.screen.question
        await pilot.press("y")
        await wait_for(pilot, lambda: bar_of(app).attached is not None)
        assert not boxes(app)  # not sent: nothing of it in the chat
        assert app.chat.query_one(PromptInput).text == ""  # attached instead
