"""The context policy (app.context_policy): budgets, summaries, what is cut and said."""

from __future__ import annotations

import pytest

from app.context_policy import ContextBudgetError, Summary, default_chat_budget, fit, plan_summary
from app.context_summary import SummaryJob, condense_prompt, note_prompt


def words(text: str) -> int:
    return len(text.split())


def chat(turns: int, size: int = 20) -> list[dict]:
    return [{"role": r, "content": f"turn {i} {r} " + "w " * size}
            for i in range(turns) for r in ("user", "assistant")]


def test_default_chat_budget_is_well_below_the_context():
    assert default_chat_budget(8192) == 2048
    assert default_chat_budget(300) == 300  # never above the context


def test_within_the_budget_nothing_is_cut():
    history = chat(3)
    f = fit(history, policy="truncate", budget=10_000, count=words, question="q")
    assert f.history == history and f.truncated_turns == 0 and f.notes() == []


def test_truncate_drops_oldest_pairs_and_says_so():
    history = chat(6)
    f = fit(history, policy="truncate", budget=80, count=words, system="be brief",
            question="why")
    assert f.history == history[-2:] and f.kept_from == 10
    assert f.truncated_turns == 5 and f.truncated_tokens > 0
    assert f.system == "be brief"  # the system text is never cut
    assert "5 oldest turn(s) left out" in f.notes()[0]
    assert f.to_dict()["truncated_turns"] == 5


def test_error_refuses_rather_than_cutting():
    with pytest.raises(ContextBudgetError, match="over its budget of 80"):
        fit(chat(6), policy="error", budget=80, count=words)


def test_summarize_sends_the_summary_instead_of_the_turns_it_covers():
    history = chat(6)
    s = Summary(messages=8, source_tokens=200, tokens=5, text="the user likes tea")
    f = fit(history, policy="summarize", budget=10_000, count=words, system="sys",
            summary=s)
    assert f.history == history[8:] and f.truncated_turns == 0
    assert f.system.startswith("sys\n\nSummary of the earlier conversation")
    assert "the user likes tea" in f.system
    assert f.notes() == ["turns 1–4 summarized (200 → 5 tokens)"]
    assert f.to_dict()["summarized_turns"] == 4
    # truncate ignores a summary: the turns are sent, or cut
    assert fit(history, policy="truncate", budget=10_000, count=words,
               summary=s).history == history


def test_summarize_without_a_summary_yet_cuts_visibly():
    f = fit(chat(6), policy="summarize", budget=80, count=words)
    assert f.truncated_turns == 5
    assert "the summary does not cover them yet" in f.notes()[0]


def test_plan_summary_waits_for_the_trigger_and_keeps_the_newest_turn():
    history = chat(6)  # 12 messages of ~27 tokens
    assert plan_summary(history, None, budget=10_000, count=words) == 0
    upto = plan_summary(history, None, budget=300, count=words)
    assert upto % 2 == 0 and 0 < upto <= len(history) - 2
    # a summary covering the start: only the turns after it are planned
    s = Summary(messages=upto, source_tokens=100, tokens=5, text="x")
    assert plan_summary(history, s, budget=300, count=words) in (0, *range(upto + 2, 11, 2))


def test_note_and_condense_prompts_hold_their_text():
    assert note_prompt("my PIN is 4817", "noted").startswith("User: my PIN is 4817\nAssistant:")
    assert "x" * 2001 not in note_prompt("x" * 5000, "")  # a huge message is read in part
    assert condense_prompt(["- a 1", "- b 2"]).startswith("Notes:\n- a 1\n- b 2")


def test_summary_round_trips_and_labels_one_turn():
    s = Summary(messages=2, source_tokens=1412, tokens=180, text="t")
    assert Summary.from_dict(s.to_dict()) == s and Summary.from_dict(None) is None
    assert s.label() == "turn 1 summarized (1,412 → 180 tokens)"


class _Handle:
    def __init__(self, events):
        self.events, self.cancelled = events, False

    def __iter__(self):
        return iter(self.events)

    def cancel(self):
        self.cancelled = True


class _Engine:
    """Answers every summary request with ``reply``; records the priority asked for."""

    def __init__(self, reply: str, finish: str = "stop"):
        self.reply, self.finish, self.priorities = reply, finish, []

    def encode_prompt(self, prompt, *, system=None, history=None):
        return [1, 2, 3]

    def count_tokens(self, text):
        return words(text)

    def submit(self, ids, params, *, priority, tenant, permission_version):
        from engine.generation import GenerationEvent

        self.priorities.append(priority)
        return _Handle([GenerationEvent(0, None, self.reply, self.finish)])


def test_summary_job_writes_one_note_per_turn_at_background_priority():
    from engine.request import Priority

    eng = _Engine("The user's dog is Pepper.")
    job = SummaryJob(eng, chat(4), None, 4)
    s = job.run()
    assert job.done and eng.priorities == [Priority.BACKGROUND] * 2 and job.requests == 2
    assert s.messages == 4 and s.text == "- The user's dog is Pepper.\n" * 1 + \
        "- The user's dog is Pepper."
    assert s.source_tokens == sum(words(m["content"]) + 4 for m in chat(4)[:4])
    # the next summary appends the new turns' notes to this one's
    again = SummaryJob(eng, chat(4), s, 6).run()
    assert again.text.count("Pepper") == 3 and again.messages == 6


def test_notes_over_their_cap_have_the_older_half_condensed():
    eng = _Engine("a note of five words")
    s = SummaryJob(eng, chat(8), None, 16, max_tokens=12).run()
    assert s.text.count("\n") < 7  # 8 notes, the older 4 condensed into one


def test_a_failed_summary_has_no_result_and_says_why():
    job = SummaryJob(_Engine("", finish="cancelled"), chat(4), None, 4)
    assert job.run() is None and "cancelled" in job.error
    cancelled = SummaryJob(_Engine("x"), chat(4), None, 4)
    cancelled.cancel()
    assert cancelled.run() is None and cancelled.requests == 0


def test_each_command_has_the_policy_flags_with_its_default():
    from app.cli import UsageError, make_parser

    parse = make_parser().parse_args
    assert parse(["chat"]).context_policy == "summarize"
    assert parse(["ask", "--doc", "f"]).context_policy == "summarize"
    assert parse(["serve"]).context_policy == "error"  # OpenAI's behaviour
    args = parse(["chat", "--context-policy", "truncate", "--context-budget", "1000"])
    assert (args.context_policy, args.context_budget) == ("truncate", 1000)
    for bad in (["chat", "--context-policy", "shift"], ["serve", "--context-budget", "10"]):
        with pytest.raises(UsageError):
            parse(bad)


def test_ran_on_notes_are_shortened_oldest_first_until_under_the_cap():
    eng = _Engine("a note of five words", finish="length")  # every note runs on
    job = SummaryJob(eng, chat(8), None, 16, max_tokens=52)
    s = job.run()
    lines = s.text.splitlines()  # 8 notes of 7 words ("…" marks a ran-on one): 56 > 52
    assert [line.endswith("…") for line in lines] == [False] * 4 + [True] * 4
    assert job.requests == 8 + 4 and s.tokens <= 52


def test_a_looping_note_is_written_again_from_the_user_message():
    from app.context_summary import looping

    assert looping("I'm sorry, I'm sorry, I'm sorry, I'm sorry, I'm …")
    assert not looping("The PIN of the lighthouse radio is 8566.")
    assert "Assistant:" not in note_prompt("my PIN is 4817", None)

    class Looping(_Engine):
        def encode_prompt(self, prompt, *, system=None, history=None):
            self.reply = "no no no no no no no" if "Assistant:" in prompt else "PIN 4817"
            return [1]

    job = SummaryJob(Looping(""), chat(1), None, 2)
    assert job.run().text == "- PIN 4817" and job.requests == 2
