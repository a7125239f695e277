#!/usr/bin/env python3
# ruff: noqa: E501, SIM115, B007  (a standalone benchmark for a separate venv, kept as run)
"""Side-by-side benchmark of structured-output grammar engines (CPU mask cost).

Engines: llguidance, xgrammar, outlines-core (each optional; missing ones are
reported as "not installed").  Standalone: it does NOT import kvchat and must
run in a separate venv that has the engines installed, e.g.

    python3 -m venv /tmp/gvenv
    /tmp/gvenv/bin/pip install llguidance xgrammar outlines-core tokenizers transformers numpy
    /tmp/gvenv/bin/python scripts/bench_grammar_engines.py --tokenizer-dir DIR [DIR ...]

Workloads (per engine, per tokenizer):
  schema  -- a fixed JSON schema (object with string/int/array/nested object + pattern)
  object  -- free JSON object ("json_object" mode; schema {"type": "object"})

Each matcher is driven with a fixed valid JSON document tokenized by the
tokenizer: before every forced token the full-vocab bitmask is computed (as a
decoder would), the forced token is checked against the mask, then consumed.

Also builds a synthetic ~150k-vocab tokenizer (no HF download needed):

    /tmp/gvenv/bin/python scripts/bench_grammar_engines.py \
        --build-extended-tokenizer OUT_DIR --base-tokenizer-dir SMOLLM2_DIR --target-vocab 151000

It continues BPE training on top of the base byte-level BPE: words from local
text (Python stdlib sources + /usr/share/common-licenses) are tokenized with
the current model, the most frequent adjacent token pairs become new merges
(appended after the original merges), repeated until the target vocab size.
"""
from __future__ import annotations

import argparse
import collections
import gc
import glob
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

SCHEMA_DOC = {
    "name": "Alice Johnson-Whitfield",
    "age": 34,
    "tags": ["engineer", "rock climbing", "coffee", "open source", "Rust"],
    "address": {"city": "San Francisco", "zip": "94107"},
}
OBJECT_DOC = {
    "id": 982341,
    "title": "Quarterly report: revenue & growth",
    "ok": True,
    "score": -12.75,
    "missing": None,
    "items": [1, 2, 3, {"k": "v", "n": 7}],
    "meta": {"author": "Bob", "langs": ["en", "de"], "ratio": 0.5},
}
# deeper nesting (array > object > array); only used as an acceptance check
# for the free-object workload (outlines-core's json_object regex is depth-bounded)
DEEP_DOC = {"a": [1, {"k": [True, {"z": [None]}]}]}

WORKLOADS = {
    "schema": (SCHEMA, json.dumps(SCHEMA_DOC)),
    "object": (OBJECT_SCHEMA, json.dumps(OBJECT_DOC)),
}


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def now() -> int:
    return time.perf_counter_ns()


def ms(ns: float) -> float:
    return ns / 1e6


def pct(xs: list[int], p: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(p / 100.0 * (len(s) - 1)))))
    return s[k]


def bit_set(mask_row: np.ndarray, tok: int) -> bool:
    return bool((int(mask_row[tok >> 5]) >> (tok & 31)) & 1)


def byte_decoder() -> dict[str, int]:
    # inverse of GPT-2 bytes_to_unicode
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=False)}


def load_hf(tok_dir: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tok = AutoTokenizer.from_pretrained(tok_dir)
    except Exception:
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"))
    n_vocab = max(tok.get_vocab().values()) + 1
    eos = tok.eos_token_id
    if eos is None:
        eos = 0
    return tok, n_vocab, eos


# --------------------------------------------------------------------------
# engine adapters: each exposes
#   setup()                                  -> tokenizer-level init (timed once)
#   compile(schema) -> grammar handle        (first + cached timed)
#   new_matcher(handle) -> matcher
#   fill(matcher, bitmask2d, row)            -> compute mask into bitmask[row]
#   consume(matcher, tok) -> bool
#   reset(matcher)
#   rollback(matcher, k)
#   batch_fill(matchers, bitmask2d) or None
# --------------------------------------------------------------------------
class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, hf_tok, n_vocab, eos, threads):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp

        self.llg, self.lnp, self.hf_tok, self.n_vocab, self.eos = llguidance, lnp, hf_tok, n_vocab, eos
        self.threads = threads
        self.version = llguidance.__version__

    def setup(self):
        self.tok = self.llg.hf.from_tokenizer(self.hf_tok, n_vocab=self.n_vocab)
        self.executor = self.llg.LLExecutor(num_threads=self.threads)

    def compile(self, schema):
        # llguidance has no compile cache: the grammar is built (lazily) in the
        # LLMatcher constructor, so "compile" == grammar_from_json_schema + ctor.
        g = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return (g, m)

    def new_matcher(self, handle):
        return self.llg.LLMatcher(self.tok, handle[0], log_level=0)

    def alloc(self, b):
        return self.lnp.allocate_token_bitmask(b, self.n_vocab)

    def fill(self, m, bm, row):
        self.lnp.fill_next_token_bitmask(m, bm, row)

    def consume(self, m, t):
        return m.consume_token(t)

    def reset(self, m):
        m.reset()

    def rollback(self, m, k):
        return m.rollback(k)

    def batch_fill(self, ms_, bm):
        self.lnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms_)], bm)

    def is_err(self, m):
        return m.is_error()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, hf_tok, n_vocab, eos, threads):
        import xgrammar as xgr

        self.xgr, self.hf_tok, self.n_vocab, self.eos, self.threads = xgr, hf_tok, n_vocab, eos, threads
        self.version = getattr(xgr, "__version__", None) or _pkg_version("xgrammar")

    def setup(self):
        self.info = self.xgr.TokenizerInfo.from_huggingface(self.hf_tok, vocab_size=self.n_vocab)
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=True)
        self.batch = self.xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def new_matcher(self, handle):
        return self.xgr.GrammarMatcher(handle)

    def alloc(self, b):
        # torch CPU tensor (what xgrammar allocates); numpy view shares memory
        t = self.xgr.allocate_token_bitmask(b, self.n_vocab)
        self._keep = getattr(self, "_keep", []) + [t]
        return t.numpy()

    def fill(self, m, bm, row):
        m.fill_next_token_bitmask(bm, row)

    def consume(self, m, t):
        return m.accept_token(t)

    def reset(self, m):
        m.reset()

    def rollback(self, m, k):
        m.rollback(k)
        return True

    def batch_fill(self, ms_, bm):
        self.batch.batch_fill_next_token_bitmask(ms_, bm)

    def is_err(self, m):
        return False


class OutlinesCoreEngine:
    name = "outlines-core"

    def __init__(self, hf_tok, n_vocab, eos, threads):
        import outlines_core as oc

        self.oc, self.hf_tok, self.n_vocab, self.eos = oc, hf_tok, n_vocab, eos
        self.version = _pkg_version("outlines_core")

    def setup(self):
        # Vocabulary.from_pretrained() only takes a Hub model id (downloads);
        # build it from the local HF tokenizer instead: byte-level tokens ->
        # raw bytes, special tokens and EOS excluded.
        dec = byte_decoder()
        special = set(self.hf_tok.all_special_ids) | {
            i for i, t in self.hf_tok.added_tokens_decoder.items() if t.special
        }
        mp: dict[bytes, list[int]] = collections.defaultdict(list)
        for s, i in self.hf_tok.get_vocab().items():
            if i in special or i == self.eos:
                continue
            try:
                b = bytes(dec[c] for c in s)
            except KeyError:
                b = s.encode("utf-8")
            mp[b].append(i)
        self.vocab = self.oc.Vocabulary(self.eos, dict(mp))
        self.words = (self.n_vocab + 31) // 32

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def new_matcher(self, handle):
        return self.oc.Guide(handle, max_rollback=64)

    def alloc(self, b):
        return np.zeros((b, self.words), dtype=np.int32)

    def fill(self, m, bm, row):
        v = bm[row]
        m.write_mask_into(v.ctypes.data, v.size, 4)

    def consume(self, m, t):
        m.advance(t, return_tokens=False)
        return True

    def reset(self, m):
        m.reset()

    def rollback(self, m, k):
        m.rollback_state(k)
        return True

    batch_fill = None

    def is_err(self, m):
        return False


ENGINES = [LLGuidanceEngine, XGrammarEngine, OutlinesCoreEngine]


def _pkg_version(name: str) -> str:
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:
        return "?"


# --------------------------------------------------------------------------
# benchmark core
# --------------------------------------------------------------------------
def drive_single(eng, handle, tokens: list[int], reps: int, bad_tok: int):
    """Force `tokens` through a matcher `reps` times; returns stats dict."""
    bm = eng.alloc(1)
    mask_ns: list[int] = []
    consume_ns: list[int] = []
    bad_forced = 0
    # first mask of a fresh matcher (cold)
    m = eng.new_matcher(handle)
    t0 = now()
    eng.fill(m, bm, 0)
    first_mask = now() - t0
    invalid_rejected = not bit_set(bm[0], bad_tok)
    for rep in range(reps + 1):  # rep 0 = warm-up, not recorded
        eng.reset(m)
        for i, t in enumerate(tokens):
            t0 = now()
            eng.fill(m, bm, 0)
            t1 = now()
            if not bit_set(bm[0], t):
                bad_forced += 1
            t2 = now()
            ok = eng.consume(m, t)
            t3 = now()
            if not ok or eng.is_err(m):
                raise RuntimeError(f"{eng.name}: consume rejected token #{i} id={t}")
            if rep:
                mask_ns.append(t1 - t0)
                consume_ns.append(t3 - t2)
        eng.fill(m, bm, 0)
        eos_ok = bit_set(bm[0], eng.eos)
    # rollback of k tokens (speculative decoding): from end, roll back 4, re-consume
    rb_ok = True
    try:
        k = 4
        t0 = now()
        eng.rollback(m, k)
        rb_ns = now() - t0
        for t in tokens[-k:]:
            eng.fill(m, bm, 0)
            rb_ok &= bit_set(bm[0], t)
            rb_ok &= bool(eng.consume(m, t))
    except Exception as e:  # noqa
        rb_ok, rb_ns = False, -1
    return dict(
        first_mask=first_mask,
        mask=mask_ns,
        consume=consume_ns,
        bad_forced=bad_forced,
        invalid_rejected=invalid_rejected,
        eos_ok=eos_ok,
        rollback_ok=rb_ok,
        rollback_ns=rb_ns,
    )


def accepts(eng, handle, tokens: list[int]) -> bool:
    m = eng.new_matcher(handle)
    bm = eng.alloc(1)
    try:
        for t in tokens:
            eng.fill(m, bm, 0)
            if not bit_set(bm[0], t) or not eng.consume(m, t) or eng.is_err(m):
                return False
        eng.fill(m, bm, 0)
        return bit_set(bm[0], eng.eos)
    except Exception:
        return False


def drive_batch(eng, handle, tokens: list[int], steps: int, parallel: bool, B: int = 8):
    """B matchers at staggered positions in the document; per step compute all
    B masks (sequential loop or the engine's batch API), then consume."""
    L = len(tokens)
    bm = eng.alloc(B)
    ms_ = [eng.new_matcher(handle) for _ in range(B)]
    pos = [0] * B
    # stagger: matcher i pre-advanced by i*L//B tokens
    for i, m in enumerate(ms_):
        for t in tokens[: i * L // B]:
            eng.consume(m, t)
        pos[i] = i * L // B
    step_ns: list[int] = []
    bad = 0
    for s in range(steps + 5):
        for i, m in enumerate(ms_):
            if pos[i] >= L:
                eng.reset(m)
                pos[i] = 0
        t0 = now()
        if parallel:
            eng.batch_fill(ms_, bm)
        else:
            for i, m in enumerate(ms_):
                eng.fill(m, bm, i)
        dt = now() - t0
        if s >= 5:
            step_ns.append(dt)
        for i, m in enumerate(ms_):
            t = tokens[pos[i]]
            if not bit_set(bm[i], t):
                bad += 1
            eng.consume(m, t)
            pos[i] += 1
    return step_ns, bad


def run_one(eng_cls, tok_dir: str, hf_tok, n_vocab, eos, reps: int, batch_steps: int, threads: int, rows, notes):
    vocab_label = f"{n_vocab // 1000}k"
    try:
        eng = eng_cls(hf_tok, n_vocab, eos, threads)
    except ImportError as e:
        notes.append(f"{eng_cls.name}: not installed ({e})")
        return
    t0 = now()
    eng.setup()
    setup_ns = now() - t0
    bad_tok = hf_tok.convert_tokens_to_ids("}")
    for wl, (schema, doc) in WORKLOADS.items():
        tokens = hf_tok.encode(doc, add_special_tokens=False)
        gc.collect()
        try:
            t0 = now()
            handle = eng.compile(schema)
            c_first = now() - t0
            again, newm = [], []
            for _ in range(5):
                t0 = now()
                handle2 = eng.compile(schema)
                again.append(now() - t0)
                t0 = now()
                m_ = eng.new_matcher(handle2)
                newm.append(now() - t0)
                del m_
            c_again, new_m = statistics.median(again), statistics.median(newm)
        except Exception as e:
            notes.append(f"{eng.name}/{vocab_label}/{wl}: compile failed: {e!r}"[:300])
            continue
        try:
            r = drive_single(eng, handle, tokens, reps, bad_tok)
        except Exception as e:
            notes.append(f"{eng.name}/{vocab_label}/{wl}: drive failed: {e!r}"[:300])
            continue
        seq, bad_s = drive_batch(eng, handle, tokens, batch_steps, parallel=False)
        if eng.batch_fill is not None:
            par, bad_p = drive_batch(eng, handle, tokens, batch_steps, parallel=True)
        else:
            par, bad_p = None, 0
        mk = r["mask"]
        sanity = []
        sanity.append("forced-ok" if r["bad_forced"] == 0 and bad_s == 0 and bad_p == 0 else
                      f"FORCED-DISALLOWED x{r['bad_forced']}/{bad_s}/{bad_p}")
        sanity.append("bad-}-rejected" if r["invalid_rejected"] else "BAD-}-ALLOWED")
        sanity.append("eos-ok" if r["eos_ok"] else "EOS-NOT-ALLOWED")
        sanity.append("rb4-ok" if r["rollback_ok"] else "ROLLBACK-FAIL")
        if wl == "object":
            sanity.append("deep-nest-ok" if accepts(eng, handle, hf_tok.encode(json.dumps(DEEP_DOC),
                          add_special_tokens=False)) else "DEEP-NEST-REJECTED")
        rows.append(dict(
            engine=f"{eng.name} {eng.version}",
            vocab=vocab_label,
            wl=wl,
            ntok=len(tokens),
            setup_ms=ms(setup_ns),
            c_first=ms(c_first),
            c_again=ms(c_again),
            new_m=ms(new_m),
            first_mask_us=r["first_mask"] / 1e3,
            mean=statistics.fmean(mk) / 1e3,
            p50=pct(mk, 50) / 1e3,
            p95=pct(mk, 95) / 1e3,
            p99=pct(mk, 99) / 1e3,
            consume=statistics.fmean(r["consume"]) / 1e3,
            rb_us=r["rollback_ns"] / 1e3,
            b8_seq=statistics.fmean(seq) / 1e3,
            b8_seq_p95=pct(seq, 95) / 1e3,
            b8_par=(statistics.fmean(par) / 1e3) if par else None,
            b8_par_p95=(pct(par, 95) / 1e3) if par else None,
            sanity=", ".join(sanity),
        ))
        print(f"  done {eng.name} {vocab_label} {wl}", file=sys.stderr, flush=True)


def fmt(v, nd=1):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def print_table(rows, notes, meta):
    print("## Grammar engine mask benchmark\n")
    for k, v in meta.items():
        print(f"- {k}: {v}")
    print()
    hdr = ["engine", "vocab", "workload", "tokens", "tok setup ms", "compile 1st ms", "compile again ms (median of 5)",
           "new matcher ms", "1st mask µs", "mask mean µs", "p50", "p95", "p99", "consume µs",
           "rollback4 µs", "b8 seq step µs (p95)", "b8 batch-API step µs (p95)", "sanity"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "|".join(["---"] * len(hdr)) + "|")
    for r in rows:
        cells = [r["engine"], r["vocab"], r["wl"], str(r["ntok"]), fmt(r["setup_ms"]), fmt(r["c_first"], 2),
                 fmt(r["c_again"], 3), fmt(r["new_m"], 3), fmt(r["first_mask_us"]), fmt(r["mean"]),
                 fmt(r["p50"]), fmt(r["p95"]), fmt(r["p99"]), fmt(r["consume"]), fmt(r["rb_us"]),
                 f"{fmt(r['b8_seq'], 0)} ({fmt(r['b8_seq_p95'], 0)})",
                 f"{fmt(r['b8_par'], 0)} ({fmt(r['b8_par_p95'], 0)})" if r["b8_par"] is not None else "n/a",
                 r["sanity"]]
        print("| " + " | ".join(cells) + " |")
    if notes:
        print("\nNotes:")
        for n in notes:
            print(f"- {n}")


# --------------------------------------------------------------------------
# synthetic large-vocab tokenizer
# --------------------------------------------------------------------------
def build_extended_tokenizer(base_dir: str, out_dir: str, target: int, max_corpus_mb: float = 40.0):
    from tokenizers import Tokenizer

    base = json.load(open(os.path.join(base_dir, "tokenizer.json"), encoding="utf-8"))
    vocab: dict[str, int] = base["model"]["vocab"]
    merges: list = base["model"]["merges"]
    merges_as_lists = isinstance(merges[0], list)
    n0 = len(vocab)
    # corpus
    files = sorted(glob.glob("/root/.pyenv/versions/*/lib/python3*/**/*.py", recursive=True))
    files += sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    files += sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob("/usr/share/doc/**/*.txt", recursive=True))
    pre = Tokenizer.from_str(json.dumps(base)).pre_tokenizer
    words: collections.Counter = collections.Counter()
    total = 0
    for f in files:
        try:
            txt = open(f, encoding="utf-8", errors="ignore").read()
        except Exception:
            continue
        total += len(txt)
        for w, _ in pre.pre_tokenize_str(txt):
            words[w] += 1
        if total > max_corpus_mb * 1e6:
            break
    print(f"corpus {total/1e6:.1f} MB, {len(words)} distinct pre-tokens", file=sys.stderr)
    wlist = list(words.items())
    rnd = 0
    while len(vocab) < target:
        rnd += 1
        tk = Tokenizer.from_str(json.dumps(base))
        model = tk.model
        pairs: collections.Counter = collections.Counter()
        for w, c in wlist:
            toks = [t.value for t in model.tokenize(w)]
            for a, b in zip(toks, toks[1:], strict=False):
                pairs[(a, b)] += c
        need = target - len(vocab)
        step = min(need, max(5000, need // 3))
        added = 0
        for (a, b), c in pairs.most_common():
            if added >= step:
                break
            s = a + b
            if s in vocab:
                continue
            vocab[s] = len(vocab)
            merges.append([a, b] if merges_as_lists else f"{a} {b}")
            added += 1
        print(f"round {rnd}: {len(pairs)} candidate pairs, +{added} -> vocab {len(vocab)}", file=sys.stderr)
        if added == 0:
            break
    # ids of added (special) tokens must stay unique / below len(vocab) -- they are in vocab already
    base["model"]["vocab"] = vocab
    base["model"]["merges"] = merges
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(base, f, ensure_ascii=False)
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        p = os.path.join(base_dir, extra)
        if os.path.exists(p):
            with open(p, encoding="utf-8") as fi, open(os.path.join(out_dir, extra), "w", encoding="utf-8") as fo:
                fo.write(fi.read())
    Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))  # validate it loads
    print(f"wrote {out_dir}: vocab {n0} -> {len(vocab)} ({rnd} rounds)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", nargs="*", default=[], help="HF tokenizer dir(s) (tokenizer.json)")
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--reps", type=int, default=30, help="passes over the document per workload")
    ap.add_argument("--batch-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for batch APIs / xgrammar compiler")
    ap.add_argument("--build-extended-tokenizer", metavar="OUT_DIR")
    ap.add_argument("--base-tokenizer-dir")
    ap.add_argument("--target-vocab", type=int, default=151000)
    a = ap.parse_args()
    if a.build_extended_tokenizer:
        build_extended_tokenizer(a.base_tokenizer_dir or a.tokenizer_dir[0], a.build_extended_tokenizer, a.target_vocab)
        if not a.tokenizer_dir:
            return
    want = set(a.engines.split(","))
    rows: list[dict] = []
    notes: list[str] = []
    meta = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "threads for batch APIs": a.threads,
            "reps": a.reps, "batch steps": a.batch_steps}
    for d in a.tokenizer_dir:
        hf_tok, n_vocab, eos = load_hf(d)
        meta[f"tokenizer {os.path.basename(d.rstrip('/'))}"] = f"n_vocab={n_vocab}, eos={eos}"
        for cls in ENGINES:
            if cls.name in want:
                print(f"[{cls.name}] {d}", file=sys.stderr, flush=True)
                run_one(cls, d, hf_tok, n_vocab, eos, a.reps, a.batch_steps, a.threads, rows, notes)
    for n in ("llguidance", "xgrammar", "outlines_core", "tokenizers", "transformers", "torch", "numpy"):
        meta.setdefault("versions", "")
        v = _pkg_version(n)
        meta["versions"] += f"{n}={v} "
    print_table(rows, notes, meta)


if __name__ == "__main__":
    main()
