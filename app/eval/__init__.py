"""kvchat's quality evaluations, one module per `kvchat eval` mode.

- `kv`: ``kvchat eval kv`` — KV cache formats compared by quality, size and speed
  (`measure` runs one format, `perplexity` scores texts through the paged pool,
  `probes` and `docs` hold the prompt sets and documents, `report` writes the outputs)
- `ask`: ``kvchat eval ask`` — document Q&A: needle recall through ``kvchat ask``'s
  policy against a plain prompt, and the TTFT the pinned document prefix saves
- `chat`: ``kvchat eval chat`` — long scripted conversations: recall of early facts
  under the context policies (summarize, truncate) and the full history
- `shift`: ``kvchat eval shift`` — context shift: perplexity of a long stream with the
  shift (re-rotated keys) against a fresh window over the same tokens and the full context
- `weights`: ``kvchat eval weights`` — kvchat's quantized CPU path against mlx-lm as
  shipped on the same weights: perplexity delta, top-1 and greedy agreement

Nothing here imports the engine at package import: building the CLI's parser must
stay cheap and must not load MLX.
"""

from __future__ import annotations


def add_parser(sub) -> None:
    """Register ``eval`` and its modes on the CLI's subparsers object."""
    from app.eval import ask, chat, kv, shift, weights

    p = sub.add_parser("eval", help="quality evaluations (KV cache formats, document Q&A, "
                                    "long chats, context shift, quantized weights)",
                       description="Quality evaluations of kvchat's settings.")
    modes = p.add_subparsers(dest="eval_mode", metavar="{kv,ask,chat,shift,weights}", required=True)
    kv.add_parser(modes)
    ask.add_parser(modes)
    chat.add_parser(modes)
    shift.add_parser(modes)
    weights.add_parser(modes)
