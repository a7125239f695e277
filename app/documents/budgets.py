"""Per-model prompt budgets for document questions, chosen by measured recall, not fit.

A window is a ceiling, not a quota: a small model reads a long prompt worse than a short
one, so a document that fits the context may still be answered better from the chunks
retrieval picks. `kvchat eval ask --curve` measures, for the model in use, needle recall
of a plain whole-document prompt against its length and of retrieval within a budget;
the budget recorded here is the prompt length past which the whole document recalls
less than retrieval does. A model without a measurement keeps its context as the
ceiling (whole documents whenever they fit), and the answer's budget says so.
"""

from __future__ import annotations

# weights fingerprint (`LoadedModel.fingerprint`) -> (prompt tokens, where it came from)
MEASURED: dict[str, tuple[int, str]] = {
    "c80c54f754e856314a92f5141db666b17f13a3336ad487b0218bd04e4ac0c4b5": (
        2048, "measured for SmolLM2-135M-Instruct Q4_1 (the default model) by `kvchat eval "
              "ask --curve` on 2026-12-02 (README, 'Document budgets'): over 60 needles in "
              "1k-8k-token documents a plain whole-document prompt recalled 52, kvchat ask "
              "with a 1k or 2k budget 60, with 4k 56 (2k chosen on the tie: more documents "
              "stay whole); held out (4k-8k tokens, 50 needles): 2k budget 48, plain 45"),
}
UNMEASURED = "no recall measurement for this model: its context is the ceiling"


def prompt_budget(loaded, override: int | None = None) -> tuple[int | None, str]:
    """(prompt ceiling in tokens or None for none, its source) for the model ``loaded``."""
    if override is not None:
        return override, "--context-budget"
    measured = MEASURED.get(getattr(loaded, "fingerprint", "") or "")
    return measured if measured is not None else (None, UNMEASURED)
