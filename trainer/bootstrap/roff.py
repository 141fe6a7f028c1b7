"""Man page rendering: roff source (man(7), mdoc(7)) to plain text, no groff needed.

The bootstrap corpus (:mod:`specops.trainer.bootstrap.corpus`) and the knowledge-base sources
(:mod:`specops.trainer.kb_sources`) read man pages through :func:`strip_roff`.
"""

from __future__ import annotations

import re

_NAMED_CHARS = {
    "em": "--",
    "en": "-",
    "hy": "-",
    "mi": "-",
    "bu": "*",
    "lq": '"',
    "rq": '"',
    "oq": "'",
    "cq": "'",
    "aq": "'",
    "dq": '"',
    "co": "(c)",
    "rg": "(R)",
    "tm": "(TM)",
    "ha": "^",
    "ti": "~",
    "rs": "\\",
    "**": "*",
    "<=": "<=",
    ">=": ">=",
    "->": "->",
    "<-": "<-",
    "mu": "x",
    "de": "deg",
    "sc": "S",
    "ba": "|",
    "br": "|",
    "pl": "+",
    "eq": "=",
    "sl": "/",
    "at": "@",
    "sh": "#",
    "Do": "$",
    "ga": "`",
    "aa": "'",
}
# pod2man / man-pages string registers seen in practice
_NAMED_STRINGS = {
    "Aq": "'",
    'L"': '"',
    'R"': '"',
    "C`": '"',
    "C'": '"',
    "lq": '"',
    "rq": '"',
    "R": "(R)",
    "Tm": "(TM)",
    "--": "--",
    "PI": "pi",
}
_ESCAPE_RE = re.compile(
    r"""\\(?:
        f(?:\[[^\]]*\]|\(..|.)        # font change
      | s[+-]?(?:\(\d\d|\[\d*\]|\d)    # size change
      | \*(?:\[(?P<sb>[^\]]*)\]|\((?P<sp>..)|(?P<s1>.))   # string register
      | n[+-]?(?:\[[^\]]*\]|\(..|.)   # number register
      | \((?P<cp>..)                   # named char \(xx
      | \[(?P<cb>[^\]]*)\]             # named char \[xx]
      | [hvwlLoDbxHSZ]'[^']*'          # motions, widths, drawing: drop
      | (?P<one>.)                     # any other single-char escape
    )""",
    re.VERBOSE,
)
_ONE_CHAR = {
    "-": "-",
    "e": "\\",
    "\\": "\\",
    " ": " ",
    "~": " ",
    "0": " ",
    "'": "'",
    "`": "`",
    ".": ".",
    "t": "\t",
    "[": "[",
    "]": "]",
    "_": "_",
}
# requests / macros that produce no text (or only layout)
_SILENT = {
    "TH",
    "PP",
    "P",
    "LP",
    "br",
    "sp",
    "RS",
    "RE",
    "nf",
    "fi",
    "in",
    "ti",
    "ad",
    "na",
    "ne",
    "ft",
    "fam",
    "hy",
    "nh",
    "ds",
    "nr",
    "rr",
    "so",
    "if",
    "ie",
    "el",
    "IX",
    "Vb",
    "Ve",
    "EX",
    "EE",
    "ll",
    "pl",
    "ps",
    "vs",
    "ta",
    "tr",
    "ss",
    "cs",
    "bp",
    "pc",
    "lf",
    "mso",
    "do",
    "ev",
    "ec",
    "eo",
    "cc",
    "c2",
    "ig",
    "am",
    "als",
    "rn",
    "rm",
    "ch",
    "wh",
    "it",
    "tm",
    "ab",
    "ex",
    "pso",
    "sy",
    "PD",
    "UE",
    "ME",
    "TS",
    "TE",
    "T&",
    "Dd",
    "Dt",
    "Os",
    "Bl",
    "El",
    "Bd",
    "Ed",
    "Pp",
    "Lp",
    "hw",
    "ns",
    "rs",
    "ce",
    "ul",
    "cu",
    "lg",
    "kern",
    "char",
    "schar",
    "fchar",
    "defcolor",
    "gcolor",
    "fcolor",
    "YS",
    "DT",
    "OP",
    "\\}",
    "}",
    '\\"',
}
_HEADINGS = {"SH", "SS", "Sh", "Ss"}
_ALTERNATING = {"BR", "RB", "BI", "IB", "IR", "RI"}
_MDOC_CALLABLE = {
    "Fl",
    "Ar",
    "Op",
    "Oo",
    "Oc",
    "Xr",
    "Nm",
    "Pa",
    "Ql",
    "Dq",
    "Sq",
    "Em",
    "Li",
    "Cm",
    "Ev",
    "Va",
    "Ic",
    "Sy",
    "No",
    "Ns",
    "Pq",
    "Bq",
    "Brq",
    "Ad",
    "Ft",
    "Fn",
    "Fa",
    "Fo",
    "Fc",
    "Dv",
    "Er",
    "Cd",
    "Ms",
    "Tn",
    "Aq",
    "It",
    "Nd",
    "Bk",
    "Ek",
    "Ux",
    "Bx",
    "At",
    "St",
    "Lk",
    "Mt",
    "Ta",
    "Sx",
    "Vt",
}


def _escape_sub(m: re.Match) -> str:
    for key, table in (
        ("sb", _NAMED_STRINGS),
        ("sp", _NAMED_STRINGS),
        ("s1", _NAMED_STRINGS),
        ("cp", _NAMED_CHARS),
        ("cb", _NAMED_CHARS),
    ):
        val = m.group(key)
        if val is not None:
            if key == "cb" and val.startswith("u") and len(val) in (5, 6):
                try:
                    return chr(int(val[1:], 16))
                except ValueError:
                    return ""
            return table.get(val, "")
    one = m.group("one")
    if one is not None:
        return _ONE_CHAR.get(one, "")
    return ""


def _inline(text: str) -> str:
    """Resolve inline escapes: fonts, named chars, strings; drop the rest."""
    i = text.find('\\"')
    if i >= 0:  # comment to end of line
        text = text[:i]
    return _ESCAPE_RE.sub(_escape_sub, text)


def _macro_args(rest: str) -> list[str]:
    """Split macro arguments the roff way: blanks separate, double quotes group."""
    args, cur, quoted, i = [], [], False, 0
    while i < len(rest):
        c = rest[i]
        if c == '"':
            if quoted and i + 1 < len(rest) and rest[i + 1] == '"':
                cur.append('"')
                i += 2
                continue
            quoted = not quoted
            if not quoted:
                args.append("".join(cur))
                cur = []
        elif c in " \t" and not quoted:
            if cur:
                args.append("".join(cur))
                cur = []
        elif c == "\\" and i + 1 < len(rest):
            cur.append(rest[i : i + 2])
            i += 2
            continue
        else:
            cur.append(c)
        i += 1
    if cur:
        args.append("".join(cur))
    return args


def strip_roff(src: str) -> str:
    """Render man(7)/mdoc(7) roff source to plain text, well enough to train on.

    Headings become their own line preceded by a blank line, paragraph macros a
    blank line, font macros their (joined) arguments, escapes their character;
    comments, macro definitions, conditionals and layout requests disappear.
    """
    out: list[str] = []
    in_def = False
    table_fmt = False

    def blank() -> None:
        if out and out[-1] != "":
            out.append("")

    for line in src.splitlines():
        if in_def:
            if line.strip() in ("..", ".."):
                in_def = False
            continue
        if table_fmt:
            if line.rstrip().endswith("."):
                table_fmt = False
            continue
        if line.startswith((".", "'")):
            body = line[1:].lstrip(" \t")
            if body.startswith(('\\"', "\\#")) or body == "":
                continue
            m = re.match(r"(\S+)\s*(.*)$", body)
            name, rest = m.group(1), m.group(2)
            if name in ("de", "de1", "ds1", "am1") or name == "ig":
                in_def = True
                continue
            if name == "TS":
                table_fmt = True
                continue
            if name.startswith(("\\}", "\\{")) or name in _SILENT:
                if name in ("PP", "P", "LP", "Pp", "Lp", "sp", "TS", "TE"):
                    blank()
                continue
            args = _macro_args(rest)
            if name in _HEADINGS:
                blank()
                out.append(_inline(" ".join(args)).strip())
                continue
            if name in ("IP", "HP", "TP", "It"):
                blank()
                if name == "IP" and args:
                    out.append(_inline(args[0]))
                elif name == "It" and args:
                    out.append(_inline(" ".join(a for a in args if a not in _MDOC_CALLABLE)))
                continue
            if name in _ALTERNATING:
                out.append(_inline("".join(args)))
                continue
            if name in ("B", "I", "SM", "SB", "UR", "MT", "Nm", "Nd", "Xr"):
                text = _inline(" ".join(args))
                if name == "Nd":
                    text = "- " + text
                if text:
                    out.append(text)
                continue
            # unknown macro (mdoc or custom): keep its words, drop mdoc callables
            words = [a for a in args if a not in _MDOC_CALLABLE]
            if words and len(name) <= 3 and name[:1].isupper():
                out.append(_inline(" ".join(words)))
            continue
        if line.endswith("\\") and not line.endswith("\\\\"):
            line = line[:-1]  # trailing backslash: line continuation
        text = _inline(line)
        if text.strip() == "" and out and out[-1] == "":
            continue
        out.append(text.rstrip())
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n" if out else ""
