"""Checks for what g++ accepts in our MSL text but Metal rejects, and resource limits.

Heuristic, text-based, for our own kernels (not a general MSL parser): run it
on the header + body MLX compiles (metal_backend.h, common.h, the .metal body).
"""

from __future__ import annotations

import re

MAX_THREADGROUP_BYTES = 32 * 1024  # Apple7+ threadgroup memory
MAX_THREADS_PER_THREADGROUP = 1024
ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")
TYPE_SIZES = {
    "float": 4,
    "int": 4,
    "uint": 4,
    "half": 2,
    "short": 2,
    "ushort": 2,
    "char": 1,
    "uchar": 1,
    "bfloat": 2,
    "bfloat16_t": 2,
    "float16_t": 2,
    "int32_t": 4,
    "uint32_t": 4,
    "int64_t": 8,
    "uint64_t": 8,
    "bool": 1,
}
_TYPE_NAMES = set(TYPE_SIZES) | {
    "T",
    "KV",
    "U",
    "float2",
    "float3",
    "float4",
    "half2",
    "half4",
    "int2",
    "int4",
    "uint2",
    "uint3",
    "uint4",
    "size_t",
}
_LANE_NAMES = ("lane", "thread_index_in_simdgroup", "thread_index_in_threadgroup", "tid")
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "static_cast"}


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _block_after(text: str, start: int) -> str:
    """The braced block, or the single statement, starting at `start`."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i : j + 1]
        return text[i:]
    end = text.find(";", i)
    return text[i : end + 1 if end >= 0 else len(text)]


def _paren_end(text: str, open_index: int) -> int:
    depth = 0
    for j in range(open_index, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j
    return len(text) - 1


def _functions(text: str) -> dict[str, str]:
    """name -> body for function definitions in `text`."""
    found = {}
    for m in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", text):
        name = m.group(1)
        if name in _KEYWORDS:
            continue
        close = _paren_end(text, m.end() - 1)
        after = text[close + 1 :]
        tail = re.match(r"\s*(const\s*)?\{", after)
        # A definition: `type name(...) {` where the previous token is a type.
        before = text[: m.start()].rstrip()
        if tail and before and (before[-1].isalnum() or before[-1] in "_>*&"):
            found[name] = _block_after(text, close + 1 + after.index("{"))
    return found


def lint_msl(text: str) -> list[str]:
    """Problems in MSL source `text` (empty when clean)."""
    code = strip_comments(text)
    problems = []
    for pattern, why in (
        (r"\bdouble\b", "double is not supported in MSL"),
        (r"\bstd::", "std:: is not available in MSL (use metal::)"),
        (r"\bprintf\s*\(", "printf is not available in MSL kernels"),
        (r"\b(?:malloc|free|new|delete)\b", "no dynamic allocation in MSL"),
    ):
        for m in re.finditer(pattern, code):
            problems.append(f"line {code.count(chr(10), 0, m.start()) + 1}: {why}")
    # Pointer declarations must name an address space.
    types = "|".join(sorted(_TYPE_NAMES, key=len, reverse=True))
    decl = re.compile(rf"(?:^|[;{{(,])\s*((?:\w+\s+)*?)(?:{types})\s*\*\s*\w+", re.M)
    for m in decl.finditer(code):
        qualifiers = m.group(1).split()
        if not any(q in ADDRESS_SPACES for q in qualifiers):
            found = " ".join(m.group(0).split()).strip(";{(, ")
            problems.append(f"pointer without address space: {found!r}")
    # Recursion (direct or mutual) among functions defined here.
    funcs = _functions(code)
    calls = {
        f: {g for g in funcs if re.search(rf"\b{g}\s*[(<]", body)} for f, body in funcs.items()
    }
    for f in funcs:
        seen, stack = set(), list(calls[f])
        while stack:
            g = stack.pop()
            if g == f:
                problems.append(f"recursion through {f}")
                break
            if g not in seen:
                seen.add(g)
                stack.extend(calls.get(g, ()))
    problems += lane_divergence(code)
    return problems


_SYNC_CALL = re.compile(r"\b(simd_\w+|threadgroup_barrier|simdgroup_barrier)\s*\(")
_ASSIGN = re.compile(r"\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)?[+\-*/|&^]?=(?!=)")
_UNIFORM_RHS = re.compile(r"\s*simd_(?:sum|max|min|broadcast|and|or|xor)\s*\(")


def _expression(code: str, start: int) -> str:
    """The expression from `start` to its `;`, or to the `)` closing a for header."""
    depth = 0
    for j in range(start, len(code)):
        ch = code[j]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                return code[start:j]
            depth -= 1
        elif ch in ";{" and depth == 0:
            return code[start:j]
    return code[start:]


def lane_varying_names(code: str) -> set[str]:
    """Identifiers whose value may differ between the lanes of a simdgroup.

    Flow-insensitive taint: the lane builtins, then every variable assigned
    (declared, indexed or compound-assigned) from an expression naming one. A
    plain `x = simd_sum(...)` stays uniform; anything else that reads a lane
    value taints. Over-approximate by design: a false alarm is cheap.
    """
    names = set(_LANE_NAMES)
    assignments = []
    for m in _ASSIGN.finditer(code):
        assignments.append((m.group(1), _expression(code, m.end())))
    changed = True
    while changed:
        changed = False
        for name, rhs in assignments:
            if name in names or _UNIFORM_RHS.match(rhs):
                continue
            if any(re.search(rf"\b{n}\b", rhs) for n in names):
                names.add(name)
                changed = True
    return names


def _mentions(text: str, names: set[str]) -> bool:
    return any(re.search(rf"\b{n}\b", text) for n in names)


def lane_divergence(code: str) -> list[str]:
    """simd_* calls and barriers that not every lane reaches.

    Flags a call under an `if`/`else`/`while` whose condition is lane-varying,
    in a `for` loop whose bound or counter is lane-varying (lanes leave the
    loop at different trips), and after a lane-varying early `return`.
    """
    varying = lane_varying_names(code)
    problems = []
    for m in re.finditer(r"\b(if|while|for)\s*\(", code):
        close = _paren_end(code, m.end() - 1)
        cond = code[m.end() : close]
        if not _mentions(cond, varying):
            continue
        block = _block_after(code, close + 1)
        after = code[close + 1 :].lstrip()[len(block) :]
        if m.group(1) == "if" and re.match(r"\s*else\b", after):
            block += _block_after(after, after.index("else") + 4)
        kind = "loop bound" if m.group(1) == "for" else "branch"
        if _SYNC_CALL.search(block):
            problems.append(f"simd/barrier call under lane-dependent {kind}: {cond.strip()!r}")
        if m.group(1) == "if" and re.search(r"\breturn\b", block):
            rest = code[close + 1 + len(block) :]
            if _SYNC_CALL.search(rest):
                problems.append(
                    f"lane-dependent return before a simd/barrier call: {cond.strip()!r}"
                )
    return problems


def threadgroup_bytes(text: str, template: dict[str, int]) -> int:
    """Threadgroup memory the MSL text declares, for the given template values."""
    code = strip_comments(text)
    total = 0
    decls = re.findall(r"\bTG_ARRAY\(\s*(\w+)\s*,\s*\w+\s*,\s*([^)]+)\)", code)
    decls += re.findall(r"\bthreadgroup\s+(\w+)\s+\w+\s*\[([^\]]+)\]", code)
    for ctype, count in decls:
        if ctype == "type":  # the macro's own definition
            continue
        value = eval(count, {"__builtins__": {}}, dict(template))  # noqa: S307 - own sources
        total += TYPE_SIZES[ctype] * int(value)
    return total
