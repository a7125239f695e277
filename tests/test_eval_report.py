"""The evals' shared writer: the Markdown table, and every figure as JSON when asked."""

from __future__ import annotations

import json

from app.eval import report


def test_publish_writes_the_table_and_the_figures(tmp_path):
    out = tmp_path / "new" / "dir"
    report.publish("| a |\n|---|", {"x": [1, 2]}, out, "ask_eval")
    assert (out / "ask_eval.md").read_text() == "| a |\n|---|\n"
    assert not list(out.glob("*.json"))
    report.publish("t", {"x": 1.5}, str(out), "chat_eval", str(tmp_path / "f.json"))
    assert json.loads((tmp_path / "f.json").read_text()) == {"x": 1.5}
    assert (out / "chat_eval.md").read_text() == "t\n"
