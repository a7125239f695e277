"""`kvchat ask --doc FILE [--doc FILE2] ["question"] [--json]`: offline document Q&A.

Documents that fit the budget go first in the prompt, whole, as a named session whose
prefix blocks stay in the prefix cache (RAM and disk) for the session's TTL: the next
question, in this process or after a restart, does not prefill them again. Documents
that do not fit take the retrieval path (`app.documents.policy`). Every answer says what
was left out. Without a question, questions are read from stdin, one per line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from app import arg_types
from app.context_policy import Summary, add_context_args
from app.context_summary import summary_job
from app.disk_state import disk_cache_json
from app.documents.load import Document, load_document
from app.documents.qa import DocumentQA, Prepared
from app.documents.sessions import DEFAULT_SESSION_TTL_S, DocSession, SessionRegistry
from app.echo import echo_events
from app.engine_args import add_engine_args, add_scope_args, build_engine
from engine.errors import KVChatError


def session_name(docs: list[Document]) -> str:
    """Default session name: first document's name and the documents' combined hash."""
    digest = hashlib.sha256("".join(d.sha256 for d in docs).encode()).hexdigest()[:12]
    return f"{docs[0].name}-{digest}"


class AskSession:
    """One `kvchat ask` run: the engine, the documents and their session record."""

    def __init__(self, eng, docs: list[Document], args):
        self.eng, self.docs, self.args = eng, docs, args
        self.qa = DocumentQA(eng, docs, chunk_tokens=args.chunk_tokens,
                             prompt_budget=args.context_budget)
        store = eng.prefix.store
        self.registry = SessionRegistry(store.root) if store is not None else None
        self.name = args.session or session_name(docs)
        self.history: list[dict] = []
        self.summary: Summary | None = None  # of the oldest turns (--context-policy summarize)

    def record(self, prepared: Prepared, ttl_s: float) -> str | None:
        """Save (or renew) the session after a whole-document answer; a notice if replaced."""
        if self.registry is None or prepared.prefix_tokens == 0:
            return None
        eng, args = self.eng, self.args
        now = time.time()
        hashes = eng.prefix_hashes(prepared.ids[:prepared.prefix_tokens], tenant=args.tenant,
                                   permission_version=args.permission_version)
        new = DocSession(
            self.name,
            [{"name": d.name, "path": d.path, "sha256": d.sha256, "tokens": n}
             for d, n in zip(self.docs, self.qa.doc_tokens, strict=True)],
            eng.loaded.fingerprint, eng.layout.kv_format, args.tenant, prepared.prefix_tokens,
            now, now + ttl_s, [h.hex() for h in hashes])
        old = self.registry.load().get(self.name)
        notice = None
        if old is not None and not old.same_content(new):
            notice = (f"session {self.name!r} held other content (a changed document, model "
                      "or KV format): it is a new session now, the old blocks are not used")
        elif old is not None and not old.expired(now):
            new.created, new.questions = old.created, old.questions
        new.questions += 1
        self.registry.save(new)
        return notice

    def ask(self, question: str) -> dict:
        from engine import SamplingParams
        from engine.generation import collect

        args = self.args
        prepared = self.qa.prepare(question, answer_tokens=args.max_tokens,
                                   history=self.history if args.follow_up_history else (),
                                   policy=args.context_policy, summary=self.summary)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temp)
        ttl = args.session_ttl
        events = self.eng.generate(prepared.ids, params, tenant=args.tenant,
                                   permission_version=args.permission_version,
                                   cache_ttl_s=ttl if prepared.prefix_tokens else None)
        result = collect(echo_events(events, show=not args.json))
        if result.finish_reason == "error":
            raise KVChatError(f"generation failed: {result.error}")
        notice = self.record(prepared, ttl)
        self.history += [{"role": "user", "content": question},
                         {"role": "assistant", "content": result.text}]
        summarized = self.summarize(prepared) if args.follow_up_history else None
        s = result.stats
        return {
            "question": question, "answer": result.text, "finish_reason": result.finish_reason,
            "session": self.name if prepared.prefix_tokens and self.registry else None,
            "documents": [{"name": d.name, "path": d.path, "sha256": d.sha256, "tokens": n}
                          for d, n in zip(self.docs, self.qa.doc_tokens, strict=True)],
            "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
            "cached_tokens": s.cached_tokens, "cache_source": s.cache_source,
            "ttft_s": s.ttft_s, "decode_tps": s.decode_tps,
            "speculation": {"proposed": s.spec_proposed, "accepted": s.spec_accepted},
            "context_shift": {"shifts": s.context_shifts, "dropped_tokens": s.shifted_tokens},
            "left_out": prepared.report(self.docs), "notice": notice,
            "summarized": summarized,
            "disk_cache": disk_cache_json(self.eng.metrics()),  # on / read-only / off, why
            **prepared.to_dict(),
        }


    def summarize(self, prepared: Prepared) -> str | None:
        """Under summarize, condense the oldest turns once they outgrow their share (run
        now, at background priority, so the next question finds it); its label, if made."""
        if self.args.context_policy != "summarize" or prepared.fitted is None:
            return None
        job = summary_job(self.eng, self.history, self.summary, budget=prepared.fitted.budget,
                          tenant=self.args.tenant,
                          permission_version=self.args.permission_version)
        if job is None:
            return None
        if job.run() is None:
            print(f"kvchat: note: the summary of older turns failed ({job.error}); they are "
                  "left out when over the budget", file=sys.stderr)
            return None
        self.summary = job.result
        return self.summary.label()


def _summary(out: dict) -> str:
    b = out["budget"]
    return (f"[{out['left_out']} | prompt {out['prompt_tokens']} tokens of a {b['total']}-token "
            f"budget, cached {out['cached_tokens']} ({out['cache_source']}) | "
            f"TTFT {out['ttft_s']:.2f}s"
            + (f" | session {out['session']}" if out["session"] else "") + "]")


def cmd_ask(args) -> int:
    docs = [load_document(p) for p in args.doc]  # bad files fail before the slow load
    questions = [args.question] if args.question is not None else None
    if questions is not None and not args.question.strip():
        raise KVChatError("the question is empty")
    eng = build_engine(args)
    for notice in eng.notices:
        print(f"kvchat: note: {notice}", file=sys.stderr)
    try:
        session = AskSession(eng, docs, args)
        if questions is None and sys.stdin.isatty():
            print(f"kvchat: {len(docs)} document(s), {session.qa.total_tokens} tokens; "
                  "one question per line, Ctrl-D to end", file=sys.stderr)
        for line in questions if questions is not None else sys.stdin:
            question = line.strip()
            if not question:
                continue
            try:
                arg_types.utf8(question)
            except argparse.ArgumentTypeError:
                raise KVChatError("a question on stdin is not valid UTF-8 text") from None
            out = session.ask(question)
            if out["notice"]:
                print(f"kvchat: note: {out['notice']}", file=sys.stderr)
            if out["summarized"]:
                print(f"kvchat: note: {out['summarized']} for the next questions",
                      file=sys.stderr)
            if args.json:
                print(json.dumps(out), flush=True)
            else:
                print(_summary(out), file=sys.stderr, flush=True)
    finally:
        eng.shutdown()  # releases the pool and drains the disk writer
    return 0


def add_parser(sub) -> None:
    a = sub.add_parser("ask", help="answer questions about local documents (offline)")
    a.add_argument("question", nargs="?", default=None, type=arg_types.utf8,
                   help="the question (none: read questions from stdin, one per line)")
    a.add_argument("--doc", action="append", required=True, metavar="FILE",
                   help="a text, Markdown or PDF file (repeatable)")
    a.add_argument("--json", action="store_true", help="one JSON object per answer")
    a.add_argument("--session", type=arg_types.non_empty, default=None,
                   help="session name (default: the document's name and content hash)")
    a.add_argument("--session-ttl", type=arg_types.duration, default=DEFAULT_SESSION_TTL_S,
                   metavar="TTL", help="how long the document's cached prefix is kept "
                   "(e.g. 12h, 7d; default 24h)")
    a.add_argument("--chunk-tokens", type=arg_types.int_in(32, 4096), default=256,
                   help="chunk size for documents that do not fit (256)")
    a.add_argument("--no-history", dest="follow_up_history", action="store_false",
                   help="follow-up questions do not see earlier answers")
    a.add_argument("--max-tokens", type=arg_types.positive_int, default=256,
                   help="max tokens per answer (256)")
    a.add_argument("--temp", type=arg_types.temperature, default=0.0,
                   help="temperature (0 = greedy)")
    add_context_args(a, default="summarize",
                     budget_help="prompt tokens for documents, question and earlier turns "
                                 "(default: measured for the model, else its context; see "
                                 "`kvchat eval ask --curve`)")
    add_scope_args(a)
    add_engine_args(a)
    a.set_defaults(func=cmd_ask)


