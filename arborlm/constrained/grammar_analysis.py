"""Which rules of a grammar can never finish: reachability and productivity.

A rule is *productive* when it derives at least one finite string. A grammar
whose root reaches an unproductive rule lets a matcher enter a state with no
finite completion: the output can never end, and xgrammar's forced-text search
(``find_jump_forward_string``) follows the endless forced text until memory runs
out (``root ::= "a" root``, or ``root ::= "a"* []`` whose character class is empty).
Refusing such grammars at compile time keeps jump-forward safe.

The grammar is read from the EBNF that ``str(xgrammar.Grammar)`` prints (after
xgrammar's normalisation), so every request kind (JSON schema, regex, EBNF,
structural tag) is analysed in one form::

    root ::= (("[" root_items{0, -1} "]") | ("x"))
    basic_string_sub ::= (("\\"") | ([^\\0-\\x1f\\"\\\\\\r\\n] basic_string_sub)) (=([ \\n\\r\\t]* [,}\\]:]))
    uuid ::= Regex("^[0-9a-f]{8}$", json_string=true)
    tags ::= TagDispatch(
      ("<f", tag_body),
      loop_after_dispatch=true,
      excludes=()
    )

Constructs outside that form (token-level expressions, rule attributes of later
xgrammar versions) raise `UnknownGrammarSyntax` rather than being guessed at.

The algorithm is the standard one for eliminating useless symbols of a
context-free grammar (Hopcroft & Ullman, "Introduction to Automata Theory,
Languages and Computation", 1979, section 4.4, lemmas 4.1 and 4.2): a least
fixpoint over the rules, where a terminal or the empty string is productive, a
sequence when all its parts are, a choice when any part is, and a repetition
when its minimum is 0 or its body is. It runs as a worklist (a rule is checked
again only when a rule it refers to turns productive).

Two constructs are taken as productive without looking inside: ``TagDispatch``
(its free text may be empty) and ``Regex(...)`` (xgrammar has parsed it; a regex
whose language is empty would be missed, as would lookahead assertions that no
continuation can satisfy; lookahead rules are still checked as rules).
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict, deque
from dataclasses import dataclass

ROOT_RULE = "root"
MAX_CODEPOINT = 0x10FFFF

# One token of the printed grammar; whitespace between tokens is skipped, and
# any other character is a token of its own (which the parser then refuses).
# Strings and character classes skip escaped characters.
_TOKEN = re.compile(
    r'"[^"\\]*(?:\\.[^"\\]*)*"'  # string literal
    r"|\[[^\]\\]*(?:\\.[^\]\\]*)*\]"  # character class
    r"|::=|\(="  # definition, lookahead
    r"|\{\s*-?\d+\s*,\s*-?\d+\s*\}"  # repetition bounds
    r"|[A-Za-z_][\w.\-]*"  # name
    r"|\S",  # punctuation (or an unknown character)
    re.DOTALL,
)
_PUNCTUATION = frozenset(["::=", "(=", "(", ")", "|", "*", "+", "?", ",", "="])
# Escapes the printer writes inside character classes (xgrammar's PrintAsEscapedUTF8).
_ESCAPES = {
    "'": 0x27, '"': 0x22, "?": 0x3F, "\\": 0x5C, "a": 0x07, "b": 0x08, "f": 0x0C, "n": 0x0A,
    "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00, "e": 0x1B, "-": 0x2D, "]": 0x5D,
}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}


class UnknownGrammarSyntax(ValueError):
    """The printed grammar holds a construct this analysis does not know."""


# ---- expressions --------------------------------------------------------------
# Built already simplified: parts that are always productive are dropped, so a
# rule's body keeps only what its productivity depends on. Compared by identity.


@dataclass(frozen=True, eq=False)
class _Always:
    """Derives a finite string whatever the other rules do (a literal, a class, ``""``)."""


@dataclass(frozen=True, eq=False)
class _Never:
    """Derives nothing (an empty character class)."""


ALWAYS, NEVER = _Always(), _Never()


@dataclass(frozen=True, eq=False)
class RuleRef:
    name: str


@dataclass(frozen=True, eq=False)
class AllOf:
    """A sequence: productive when every part is."""

    parts: tuple


@dataclass(frozen=True, eq=False)
class AnyOf:
    """A choice: productive when some option is."""

    options: tuple


def all_of(parts: list):
    parts = [p for p in parts if p is not ALWAYS]
    if NEVER in parts:
        return NEVER
    return ALWAYS if not parts else parts[0] if len(parts) == 1 else AllOf(tuple(parts))


def any_of(options: list):
    options = [o for o in options if o is not NEVER]
    if ALWAYS in options:
        return ALWAYS
    return NEVER if not options else options[0] if len(options) == 1 else AnyOf(tuple(options))


def repeat(body, min_count: int):
    """``body`` at least ``min_count`` times: productive when that minimum is 0 or the body is."""
    return ALWAYS if min_count <= 0 else body


@dataclass(frozen=True)
class Rule:
    """name ::= body; ``refs``: every rule named in the body, its lookahead or its dispatches."""

    name: str
    body: object
    refs: tuple[str, ...]


# ---- character classes --------------------------------------------------------


def _class_codepoints(text: str) -> list[int]:
    """The codepoints written between ``[`` (or ``[^``) and ``]``; ``-`` between two is a range marker (-1)."""
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char == "-":
            out.append(-1)
            i += 1
        elif char != "\\":
            out.append(ord(char))
            i += 1
        elif text[i + 1] in _HEX_WIDTH:
            width = _HEX_WIDTH[text[i + 1]]
            digits = text[i + 2 : i + 2 + width]
            if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise UnknownGrammarSyntax(f"bad escape in character class [{text}]")
            out.append(int(digits, 16))
            i += 2 + width
        elif text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            raise UnknownGrammarSyntax(f"unknown escape \\{text[i + 1]} in character class [{text}]")
    return out


def _class_ranges(text: str) -> list[tuple[int, int]]:
    codepoints, ranges, i = _class_codepoints(text), [], 0
    while i < len(codepoints):
        low = codepoints[i]
        if low == -1:
            raise UnknownGrammarSyntax(f"unescaped '-' in character class [{text}]")
        if i + 2 < len(codepoints) and codepoints[i + 1] == -1 and codepoints[i + 2] != -1:
            ranges.append((low, codepoints[i + 2]))
            i += 3
        else:
            ranges.append((low, low))
            i += 1
    return ranges


@functools.lru_cache(maxsize=4096)
def char_class_is_empty(token: str) -> bool:
    """Whether a printed character class (``[a-z]``, ``[^\\0-\\x1f]``) matches no codepoint."""
    body = token[1:-1]
    negated = body.startswith("^")
    ranges = _class_ranges(body[1:] if negated else body)
    if not negated:
        return not any(low <= high for low, high in ranges)
    covered = 0  # codepoints [0, covered) are excluded
    for low, high in sorted(ranges):
        if low > covered:
            return False
        covered = max(covered, high + 1)
    return covered > MAX_CODEPOINT


# ---- parsing ------------------------------------------------------------------


def tokenize(text: str) -> list[str]:
    """The tokens of a printed grammar, whitespace dropped, then "" as an end marker."""
    tokens = _TOKEN.findall(text)
    tokens.append("")
    return tokens


class _Parser:
    """Recursive descent over the tokens of ``str(xgrammar.Grammar)``.

    grammar  := rule*
    rule     := NAME "::=" choice ["(=" choice ")"]
    choice   := sequence ("|" sequence)*
    sequence := postfix+            (ends before "|", ")", "(=", "," or the next rule)
    postfix  := primary ["*" | "+" | "?" | "{m, n}"]
    primary  := STRING | CLASS | NAME | "(" choice ")" | TagDispatch(...) | Regex(STRING [, NAME=NAME])
    """

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.i = 0
        self.refs: list[str] = []  # of the rule being parsed

    def fail(self, expected: str):
        found = self.tokens[self.i]
        raise UnknownGrammarSyntax(f"expected {expected}, found {found!r} (token {self.i})" if found
                                   else f"expected {expected}, found the end")

    def take(self, token: str) -> None:
        if self.tokens[self.i] != token:
            self.fail(repr(token))
        self.i += 1

    def take_name(self) -> str:
        token = self.tokens[self.i]
        if not _is_name(token):
            self.fail("a name")
        self.i += 1
        return token

    def take_string(self) -> None:
        if not _is_string(self.tokens[self.i]):
            self.fail("a string")
        self.i += 1

    def rules(self) -> list[Rule]:
        rules = []
        while self.tokens[self.i]:
            rules.append(self.rule())
        return rules

    def rule(self) -> Rule:
        name = self.take_name()
        self.take("::=")
        self.refs = []
        body = self.choice()
        if self.tokens[self.i] == "(=":
            self.i += 1
            self.choice()  # only its references matter
            self.take(")")
        return Rule(name, body, tuple(self.refs))

    def choice(self):
        options = [self.sequence()]
        while self.tokens[self.i] == "|":
            self.i += 1
            options.append(self.sequence())
        return any_of(options)

    def sequence(self):
        parts, tokens = [], self.tokens
        while tokens[self.i] not in _SEQUENCE_END and tokens[self.i + 1] != "::=":
            parts.append(self.postfix(self.primary()))
        if not parts:
            self.fail("an expression")
        return all_of(parts)

    def postfix(self, item):
        token = self.tokens[self.i]
        if token in ("*", "?", "+"):
            self.i += 1
            return repeat(item, 1 if token == "+" else 0)
        if token.startswith("{"):
            self.i += 1
            return repeat(item, int(token[1:].split(",")[0]))
        return item

    def primary(self):
        token, following = self.tokens[self.i], self.tokens[self.i + 1]
        if _is_string(token):
            self.i += 1
            return ALWAYS
        if len(token) > 1 and token[0] == "[" and token[-1] == "]":
            self.i += 1
            return NEVER if char_class_is_empty(token) else ALWAYS
        if token == "TagDispatch" and following == "(":
            return self.tag_dispatch()
        if token == "Regex" and following == "(":
            return self.regex()
        if _is_name(token):
            self.i += 1
            self.refs.append(token)
            return RuleRef(token)
        if token == "(":
            self.i += 1
            inner = self.choice()
            self.take(")")
            return inner
        self.fail("an expression")

    def tag_dispatch(self):
        """``TagDispatch(("trigger", rule), ..., option=value, ...)``: free text, possibly empty."""
        self.i += 2
        while self.tokens[self.i] != ")":
            if self.tokens[self.i] == "(":
                self.i += 1
                self.take_string()
                self.take(",")
                self.refs.append(self.take_name())
                self.take(")")
            else:
                self.option()
            if self.tokens[self.i] == ",":
                self.i += 1
        self.take(")")
        return ALWAYS

    def regex(self):
        """``Regex("pattern", json_string=true)``: taken as productive (see the module docstring)."""
        self.i += 2
        self.take_string()
        while self.tokens[self.i] == ",":
            self.i += 1
            self.option()
        self.take(")")
        return ALWAYS

    def option(self) -> None:
        """``name=value`` where the value is a name (true, false) or a tuple of strings; skipped."""
        self.take_name()
        self.take("=")
        if self.tokens[self.i] != "(":
            self.take_name()
            return
        self.i += 1
        while self.tokens[self.i] != ")":
            self.take_string()
            if self.tokens[self.i] == ",":
                self.i += 1
        self.i += 1


_SEQUENCE_END = frozenset(["|", ")", "(=", ",", ""])


def _is_name(token: str) -> bool:
    return bool(token) and (token[0].isalpha() or token[0] == "_") and token not in _PUNCTUATION


def _is_string(token: str) -> bool:
    return len(token) > 1 and token[0] == '"' and token[-1] == '"'


def parse_grammar(text: str) -> dict[str, Rule]:
    """The rules of a printed xgrammar grammar, by name.

    Raises
    ------
    UnknownGrammarSyntax
        A construct outside the printed form, a rule defined twice, or a
        reference to an undefined rule.
    """
    try:
        rules = _Parser(tokenize(text)).rules()
    except RecursionError as e:
        raise UnknownGrammarSyntax("expressions nested too deeply") from e
    by_name: dict[str, Rule] = {}
    for rule in rules:
        if rule.name in by_name:
            raise UnknownGrammarSyntax(f"rule {rule.name!r} is defined twice")
        by_name[rule.name] = rule
    for rule in rules:
        for name in rule.refs:
            if name not in by_name:
                raise UnknownGrammarSyntax(f"rule {rule.name!r} refers to undefined rule {name!r}")
    return by_name


# ---- analysis -----------------------------------------------------------------


def reachable_rules(rules: dict[str, Rule], root: str = ROOT_RULE) -> list[str]:
    """Rules reachable from ``root`` through bodies, lookaheads and dispatches, in visiting order."""
    seen, order = {root}, [root]
    for name in order:  # grows while iterating: a breadth-first search
        for ref in rules[name].refs:
            if ref not in seen:
                seen.add(ref)
                order.append(ref)
    return order


def _is_productive(expr, productive: set[str]) -> bool:
    """Whether ``expr`` derives a finite string, given the rules known to be productive."""
    if isinstance(expr, RuleRef):
        return expr.name in productive
    if isinstance(expr, AllOf):
        return all(_is_productive(part, productive) for part in expr.parts)
    if isinstance(expr, AnyOf):
        return any(_is_productive(option, productive) for option in expr.options)
    return expr is ALWAYS


def productive_rules(rules: dict[str, Rule], names: list[str]) -> set[str]:
    """The productive ones among ``names`` (a set closed under references), by worklist fixpoint."""
    users = defaultdict(list)
    for name in names:
        for ref in set(rules[name].refs):
            users[ref].append(name)
    productive: set[str] = set()
    queue, queued = deque(names), set(names)
    while queue:
        name = queue.popleft()
        queued.discard(name)
        if name in productive or not _is_productive(rules[name].body, productive):
            continue
        productive.add(name)
        for user in users[name]:
            if user not in productive and user not in queued:
                queued.add(user)
                queue.append(user)
    return productive


def unproductive_reachable_rules(grammar_text: str, root: str = ROOT_RULE) -> list[str]:
    """Rules reachable from ``root`` that derive no finite string, in reachability order.

    Parameters
    ----------
    grammar_text: the EBNF ``str(xgrammar.Grammar)`` prints.
    root: the start rule.

    Returns
    -------
    The names ([] when every reachable rule can finish).

    Raises
    ------
    UnknownGrammarSyntax
        The text holds a construct this analysis does not know, or has no ``root`` rule.
    """
    rules = parse_grammar(grammar_text)
    if root not in rules:
        raise UnknownGrammarSyntax(f"no rule named {root!r}")
    reachable = reachable_rules(rules, root)
    productive = productive_rules(rules, reachable)
    return [name for name in reachable if name not in productive]
