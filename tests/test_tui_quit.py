"""Quitting the chat on the real engine ends the process cleanly, idle or mid-answer.

Each run is a fresh interpreter (a crash at exit only shows there): the app runs headless,
loads the default model, optionally starts a long answer, then quits with Ctrl+C (busy:
twice, the first cancels; racing: Enter and Ctrl+C twice queued together, so the quit
lands while the question is being mounted), and ends as the CLI does (`run_app`, then
`exit_now`). The process must exit 0 with no native "terminate called" abort and no
traceback. KVCHAT_QUIT_RUNS sets the runs per state (the
issue's check is 50; 2 by default, as each run loads the model).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import home_sharing_builds

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

RUNS = int(os.environ.get("KVCHAT_QUIT_RUNS", "2"))

SCRIPT = textwrap.dedent("""
    import sys, tempfile
    from functools import partial
    from app.conversations import ConversationStore
    from app.tui.app import default_engine_factory, exit_now, run_app
    from app.tui.widgets.prompt_input import PromptInput
    from engine import EngineConfig
    from textual import events

    busy, racing = sys.argv[1] == "busy", sys.argv[1] == "racing"

    async def auto_pilot(pilot):
        app = pilot.app
        while app.engine is None:
            await pilot.pause(0.05)
        if racing:
            app.chat.query_one(PromptInput).text = "Write a long story about bread."
            for key, char in (("enter", "\\r"), ("ctrl+c", None), ("ctrl+c", None)):
                app.post_message(events.Key(key, char))
            return
        if busy:
            app.chat.query_one(PromptInput).text = "Write a long story about bread."
            await pilot.press("enter")
            while not (app.chat.answer is not None and app.chat.answer.text):
                await pilot.pause(0.02)
        await pilot.press("ctrl+c")
        if busy:
            await pilot.press("ctrl+c")

    factory = partial(default_engine_factory,
                      config=EngineConfig(kv_budget_bytes=32 << 20, prefill_chunk=64))
    app = run_app(engine_factory=factory, remember=False, max_tokens=400,
                  store=ConversationStore(tempfile.mkdtemp()),
                  headless=True, auto_pilot=auto_pilot)
    assert app.engine is None, "the engine was not stopped"
    print("quit ok")
    exit_now(app.return_code or 0)  # the CLI's own end (app.tui.run)
""")


# Quitting mid-answer aborted now and then at exit ("terminate called without an active
# exception"): mx.compile on the engine thread (compile is off on CPU), then, most likely, a
# launched decode's K/V writes still queued on the engine thread's own MLX stream as the
# thread ended (it now settles its stream first). KVCHAT_QUIT_RUNS=50: 50/50 busy and 50/50
# idle clean (the rare abort did not show in 35 runs without the fix either). CI on 66f15e2
# still caught one idle abort in the interpreter's finalization, which the CLI never reaches
# (it ends by os._exit): the script now ends the CLI's way, so this checks what users run.
@pytest.mark.parametrize("state", ["idle", "busy", "racing"])
def test_quit_exits_cleanly(state, tmp_path):
    env = {**os.environ, "KVCHAT_HOME": home_sharing_builds(tmp_path / "home")}
    for i in range(RUNS):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, state], capture_output=True,
                              text=True, timeout=240, env=env,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
        assert "terminate called" not in proc.stderr, (i, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr + proc.stdout, (i, proc.stderr[-2000:])
        assert proc.returncode == 0 and "quit ok" in proc.stdout, (i, proc.stderr[-2000:])
