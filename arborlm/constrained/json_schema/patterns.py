"""JSON Schema ``pattern`` regexes rewritten for a grammar backend.

JSON Schema patterns use ECMA-262 syntax with search semantics (a pattern matches
anywhere in the string) and ``jsonschema`` evaluates them with Python's `re`;
xgrammar matches a regex against the whole string. These helpers turn a search
pattern into a full-match one, fold ``minLength``/``maxLength`` into it, exclude
words (for ``not: {enum: ...}``), drop lookarounds the grammar cannot express,
and ask xgrammar whether it accepts a pattern. `lower` calls them while
lowering a schema. Matching a pattern against text (a user's strings) goes
through the job's `RegexBudget` (`regex_budget`), never through `re`.
"""

from __future__ import annotations

import functools
import re

from arborlm.constrained.json_schema.regex_budget import RegexBudget

# Smallest bound `pattern_with_lengths` puts on a repeat to fit maxLength (below it: refuse).
MIN_REPEAT_CAP = 4


def _regex_tokens(pattern: str) -> list[str]:
    """Split a regex into escapes, character classes, and single characters."""
    tokens, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            tokens.append(pattern[i : i + 2])
            i += 2
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            tokens.append(pattern[i : j + 1])
            i = j + 1
        else:
            tokens.append(c)
            i += 1
    return tokens


def _group_opens(tokens: list[str], k: int) -> str:
    """The lookaround kind ('(?=', '(?!', '(?<=', '(?<!') opened at tokens[k], or ''."""
    head = "".join(tokens[k : k + 4])
    for kind in ("(?<=", "(?<!", "(?=", "(?!"):
        if head.startswith(kind):
            return kind
    return ""


def has_lookaround(pattern: str) -> bool:
    tokens = _regex_tokens(pattern)
    return any(t == "(" and _group_opens(tokens, k) for k, t in enumerate(tokens))


def strip_lookarounds(pattern: str) -> str:
    """The pattern without its lookaround groups (a wider language)."""
    tokens, out, k = _regex_tokens(pattern), [], 0
    while k < len(tokens):
        if tokens[k] == "(" and _group_opens(tokens, k):
            depth = 0
            while k < len(tokens):
                depth += tokens[k] == "("
                depth -= tokens[k] == ")"
                k += 1
                if depth == 0:
                    break
            continue
        out.append(tokens[k])
        k += 1
    return "".join(out)


def full_match_pattern(pattern: str) -> str:
    """A pattern whose whole-string matches are exactly the original's search matches.

    ``^a$`` stays; ``abc`` → ``^.*abc.*$``; ``^a|b$`` → ``^(?:a.*|.*b)$``;
    ``(^a$)|(^b$)`` → ``^(?:(?:a)|(?:b))$``. Python's ``re.search`` gives the
    result the same matches, except that ``.`` does not match a newline
    (narrower), so `jsonschema` and xgrammar agree on it.
    """
    body = _full_match_body(_regex_tokens(pattern))
    if body.startswith("(?:") and _closing_paren(_regex_tokens(body), 0) == len(_regex_tokens(body)) - 1:
        body = body[3:-1] if "|" not in body else body
    return _optional_groups_as_ranges("^" + body + "$")


def _optional_groups_as_ranges(pattern: str) -> str:
    """``(...)?`` written ``(...){0,1}``: xgrammar 0.2.9 mis-compiles an optional group in a
    JSON-schema pattern (``^(a.*)?$`` accepts ``"b"``), not the equivalent range."""
    tokens = _regex_tokens(pattern)
    return "".join("{0,1}" if t == "?" and k > 0 and tokens[k - 1] == ")" else t for k, t in enumerate(tokens))


def _full_match_body(tokens: list[str]) -> str:
    """The unanchored body of `full_match_pattern` for a token list."""
    alternatives, current, depth = [], [], 0
    for t in tokens:
        depth += t == "("
        depth -= t == ")"
        if t == "|" and depth == 0:
            alternatives.append(current)
            current = []
        else:
            current.append(t)
    alternatives.append(current)
    parts = []
    for alt in alternatives:
        if alt and alt[0] == "(" and _closing_paren(alt, 0) == len(alt) - 1 and not _group_opens(alt, 0):
            inner = alt[1:-1]
            if inner[:2] == ["?", ":"]:
                inner = inner[2:]
            elif inner[:1] == ["?"]:  # a named group or inline flags: leave it whole
                inner = None
            if inner is not None:
                parts.append("(?:" + _full_match_body(inner) + ")")
                continue
        starts = bool(alt) and alt[0] == "^"
        ends = len(alt) > starts and alt[-1] == "$"
        core_tokens = alt[int(starts) : len(alt) - int(ends)]
        if not starts and core_tokens[:2] == [".", "*"]:
            starts = True  # already open at the front
        if not ends and core_tokens[-2:] == [".", "*"]:
            ends = True
        parts.append(("" if starts else ".*") + "".join(core_tokens) + ("" if ends else ".*"))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _closing_paren(tokens: list[str], k: int) -> int:
    """Index of the ")" that closes the "(" at tokens[k] (-1 when unbalanced)."""
    depth = 0
    for j in range(k, len(tokens)):
        depth += tokens[j] == "("
        depth -= tokens[j] == ")"
        if depth == 0:
            return j
    return -1


_ONE_ATOM = re.compile(
    r"\^(\(?)(\[(?:\\.|[^\]\\])+\]|\\.|\.|[^\\^$.|?*+()\[\]{}])(\)?)"
    r"(\*|\+|\{(\d+)(?:(,)(\d*))?\})\$"
)


def _fold_lengths(pattern: str, min_length: int, max_length: int | None) -> str | None:
    """``^ATOM{m,n}$`` with the length bounds folded in, or None if the pattern is not one atom.

    A pattern that is one atom repeated (``^[a-z0-9_]+$``) matches strings of
    one character per repetition, so lengths become its quantifier's bounds.
    Returns "" when no length fits.
    """
    m = _ONE_ATOM.fullmatch(pattern)
    if m is None or bool(m.group(1)) != bool(m.group(3)):
        return None
    quant = m.group(4)
    if quant == "*":
        low, high = 0, None
    elif quant == "+":
        low, high = 1, None
    else:
        low = int(m.group(5))
        high = (int(m.group(7)) if m.group(7) else None) if m.group(6) else low
    low = max(low, min_length)
    if max_length is not None:
        high = max_length if high is None else min(high, max_length)
    if high is not None and low > high:
        return ""
    return f"^{m.group(2)}{{{low},{'' if high is None else high}}}$"


def is_vacuous(pattern: str, budget: RegexBudget) -> bool:
    """True when every string contains a match: the empty string matches, and nothing but
    ``^`` asserts anything about the text around a match (an empty match at 0 always exists).

    Raises `PatternTimeout` when matching the empty string outlives ``budget``.
    """
    tokens = _regex_tokens(pattern)
    if any(t == "$" or t in ("\\Z", "\\b", "\\B", "\\z") for t in tokens):
        return False
    return not has_lookaround(pattern) and budget.search(pattern, "")


def _regex_width(pattern: str) -> tuple[int, int | None] | None:
    """(min, max) length of the strings a full-match pattern matches (max None: unbounded)."""
    parser = getattr(re, "_parser", None)  # CPython's regex parser (sre_parse before 3.11)
    if parser is None:  # pragma: no cover
        return None
    try:
        low, high = parser.parse(pattern).getwidth()
    except Exception:  # pragma: no cover - the pattern compiled already
        return None
    return low, (None if high >= 2**31 else high)


def _cap_repeats(pattern: str, cap: int) -> str | None:
    """The pattern with every unbounded repeat (``*``, ``+``, ``{n,}``) bounded by ``cap``."""
    tokens, out, k = _regex_tokens(pattern), [], 0
    while k < len(tokens):
        t = tokens[k]
        if t in ("*", "+"):
            out.append(f"{{{0 if t == '*' else 1},{cap}}}")
            k += 1
            if k < len(tokens) and tokens[k] == "+":
                return None  # possessive: a different language
            if k < len(tokens) and tokens[k] == "?":
                k += 1
            continue
        if t == "{":
            m = re.match(r"\{(\d+),\}", "".join(tokens[k : k + 8]))
            if m:
                low = int(m.group(1))
                out.append(f"{{{low},{max(low, cap)}}}")
                k += len(m.group(0))
                continue
        out.append(t)
        k += 1
    return "".join(out)


def pattern_with_lengths(pattern: str, min_length: int, max_length: int | None) -> str | None:
    """One full-match pattern for ``pattern`` and the length bounds ("" when none fits).

    Lengths the pattern already implies are dropped; a pattern that is one atom
    repeated takes them as its quantifier's bounds (exact); otherwise a
    ``maxLength`` bounds every unbounded repeat by the largest cap (at least
    `MIN_REPEAT_CAP`) that keeps the longest match within it (narrower: some
    long strings the schema allows are not generated). None when no rewrite
    works (a minLength the pattern does not imply, a cap too small).
    """
    width = _regex_width(pattern)
    if width is None:
        return None
    low, high = width
    fits_max = max_length is None or (high is not None and high <= max_length)
    if low >= min_length and fits_max:
        return pattern
    folded = _fold_lengths(pattern, min_length, max_length)
    if folded is not None or low < min_length:
        return folded
    if max_length < low:
        return ""
    best = None
    lo_cap, hi_cap = MIN_REPEAT_CAP, max(MIN_REPEAT_CAP, max_length)
    while lo_cap <= hi_cap:
        cap = (lo_cap + hi_cap) // 2
        capped = _cap_repeats(pattern, cap)
        capped_width = None if capped is None else _regex_width(capped)
        if capped_width is None or capped_width[1] is None:
            return None
        if capped_width[1] <= max_length:
            best, lo_cap = capped, cap + 1
        else:
            hi_cap = cap - 1
    return best


def exclude_words(pattern: str, words: list[str]) -> str | None:
    """A full-match pattern for the strings ``pattern`` matches, except ``words``.

    For patterns of three shapes (after `full_match_pattern`): any string
    (``^.*$``), a literal prefix then anything (``^x_.*$``), or one ASCII
    character class repeated (``^[a-zA-Z0-9_]*$``, ``^([a-z])+$``); None for
    others. The result spells out the complement of the words as a trie:
    strings that leave the trie early, or end where no word ends.
    """
    full = full_match_pattern(pattern)
    prefix, alphabet, minimum = "", None, 0
    literal = re.fullmatch(r"\^((?:[A-Za-z0-9_ :/@-]|\\[.\-/])*)\.\*\$", full)
    if literal is not None:
        prefix = re.sub(r"\\(.)", r"\1", literal.group(1))
    else:
        m = re.fullmatch(r"\^(\(?)(\[(?:\\.|[^\]\\])+\])(\)?)([*+])\$", full)
        if m is None or bool(m.group(1)) != bool(m.group(3)) or not _ascii_class(m.group(2)):
            return None
        alphabet = [chr(c) for c in range(128) if re.fullmatch(m.group(2), chr(c))]
        minimum = 1 if m.group(4) == "+" else 0
    words_set = {w[len(prefix) :] for w in words if w.startswith(prefix)}
    if alphabet is not None:
        words_set = {w for w in words_set if all(c in alphabet for c in w)}
    if minimum:
        words_set.add("")
    any_char = "." if alphabet is None else _char_class(alphabet)

    def others(firsts: list[str]) -> str:
        if alphabet is None:
            return _char_class(firsts, negate=True)
        rest = [c for c in alphabet if c not in firsts]
        return _char_class(rest) if rest else ""

    def complement(ws: set[str]) -> str:
        if not ws:
            return any_char + "*"
        firsts = sorted({w[0] for w in ws if w})
        alternatives = []
        leave = others(firsts)
        if leave:
            alternatives.append(leave + any_char + "*")
        for c in firsts:
            alternatives.append(re.escape(c) + complement({w[1:] for w in ws if w and w[0] == c}))
        body = "(?:" + "|".join(alternatives) + ")"
        return body if "" in ws else body + "?"

    return _optional_groups_as_ranges("^" + re.escape(prefix) + complement(words_set) + "$")


def _ascii_class(cls: str) -> bool:
    """True for a non-negated character class of ASCII characters without class escapes."""
    body = cls[1:-1]
    return not body.startswith("^") and body.isascii() and not re.search(r"\\[A-Za-z]", body)


def _char_class(chars: list[str], negate: bool = False) -> str:
    """A character class for ``chars`` (sorted), runs written as ranges."""
    codes = sorted({ord(c) for c in chars})
    runs: list[list[int]] = []
    for code in codes:
        if runs and code == runs[-1][1] + 1:
            runs[-1][1] = code
        else:
            runs.append([code, code])

    def one(code: int) -> str:
        c = chr(code)
        return "\\" + c if c in "\\]^-[" else c

    body = "".join(one(a) if a == b else one(a) + ("" if b == a + 1 else "-") + one(b) for a, b in runs)
    return "[^" + body + "\\n]" if negate else "[" + body + "]"


@functools.lru_cache(maxsize=1024)
def xgrammar_regex_error(pattern: str) -> str | None:
    """Why xgrammar cannot compile ``pattern`` (None when it can, or without xgrammar)."""
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - xgrammar is a dependency
        return None
    try:
        xgrammar.Grammar.from_regex(pattern)
    except Exception as e:  # xgrammar raises RuntimeError with a C++ log prefix
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return re.sub(r"^\[[\d:]+\] \S+?:\d+: ", "", message)
    return None


# Largest repeat bound xgrammar 0.2.9 expands when it compiles a JSON-schema pattern (measured:
# ``{0,128}`` compiles in seconds into copies, ``{0,199}`` in 0.2 s into a counted repeat).
XGRAMMAR_EXPANDED_REPEAT = 128
_QUANTIFIER_STARTS = ("+", "*", "?", "{")


def separator_first_repeat(pattern: str) -> str:
    """``^(?:AB){m,n}A$`` written ``^A(?:BA){m,n}$`` when ``n`` is absent or > `XGRAMMAR_EXPANDED_REPEAT`.

    The same language: (AB)^k A = A (BA)^k. A full-match pattern (as
    `full_match_pattern` writes them) of another shape, with a ``|`` or an
    anchor inside the group, or a smaller bound comes back unchanged.

    Why: xgrammar 0.2.9 does not expand a repeat bounded above 128, and in the
    first form a mask fill then checks nearly every token at run time: inside
    ``^(?:\\S+\\s+){0,199}\\S+$`` (JSONSchemaBench Github_hard o21074) a fill
    took 29 ms, inside ``^\\S+(?:\\s+\\S+){0,199}$`` 0.1 ms (SmolLM2, 49152
    tokens); with a bound of 99 both forms fill in about 25 µs.
    """
    tokens = _regex_tokens(pattern)
    if tokens[:4] != ["^", "(", "?", ":"] or tokens[-1:] != ["$"]:
        return pattern
    close = _closing_paren(tokens, 1)
    if close < 0 or close + 1 >= len(tokens) or tokens[close + 1] != "{":
        return pattern
    end = tokens.index("}", close + 1) if "}" in tokens[close + 1 :] else -1
    bounds = "".join(tokens[close + 2 : end]).split(",")
    if end < 0 or len(bounds) != 2 or not all(b.isdigit() for b in bounds if b) or not bounds[0]:
        return pattern
    if bounds[1] and int(bounds[1]) <= XGRAMMAR_EXPANDED_REPEAT:
        return pattern
    group, tail = tokens[4:close], tokens[end + 1 : -1]
    head, rest = group[: len(tail)], group[len(tail) :]
    if not tail or head != tail or not rest or rest[0] in _QUANTIFIER_STARTS:
        return pattern
    if any(t in ("|", "^", "$") for t in group) or _closing_paren(["("] + tail + [")"], 0) != len(tail) + 1:
        return pattern
    atom, separator = "".join(tail), "".join(rest)
    return f"^{atom}(?:{separator}{atom}){''.join(tokens[close + 1 : end + 1])}$"
