"""The command line's output constraints (``--json-schema``, ``--json-object``, ``--regex``,
``--grammar``) as an `engine.Constraint`: shared by ``kvchat generate`` and ``bench decode``."""

from __future__ import annotations

from app import arg_types
from engine.errors import KVChatError

CONSTRAINT_FILE_BYTES = 256_000


def read_constraint(args):
    """--json-schema / --json-object / --regex / --grammar as an `engine.Constraint`."""
    from engine import Constraint
    from engine.errors import RequestError

    try:
        if args.json_object:
            return Constraint("json_object")
        if args.regex is not None:
            return Constraint("regex", args.regex)
        for flag, path in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
            if path is None:
                continue
            try:
                text = arg_types.read_text_file(path, CONSTRAINT_FILE_BYTES)
            except ValueError as e:
                raise KVChatError(f"cannot read {flag} file: {e}") from None
            return Constraint.json_schema(text) if flag == "--json-schema" \
                else Constraint("grammar", text)
    except RequestError as e:
        raise KVChatError(str(e)) from None
    return None
