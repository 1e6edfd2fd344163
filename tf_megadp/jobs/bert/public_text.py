"""More offline public English text for the public corpus, source by source.

The job's offline default corpus is docstrings of four installed packages
(`tf_megadp.jobs.bert.corpus.default_corpus_documents`). A public model
that has learned needs more text, and every installation carries some that
nothing has to download. Each source here is read from the files this
machine has, in Python (no `man`, `groff` or pandoc needed), and cut into
paragraphs of English prose:

- ``"docstrings"``: today's docstrings (the standard library, numpy, keras,
  tensorflow);
- ``"more-docstrings"``: docstrings of every other Python package installed
  beside this one;
- ``"man"``: the English manual pages, ``/usr/share/man/man1`` to ``man8``
  (roff, ``man`` and ``mdoc`` macros, plain or compressed);
- ``"doc"``: text documentation under ``/usr/share/doc``: README, NEWS and
  FAQ files, ``.txt``, ``.md``, ``.rst`` and ``.html`` (plain or gzipped);
  not copyright, license or changelog files;
- ``"package-docs"``: the ``.md``, ``.rst`` and ``.txt`` files and the package
  descriptions (``METADATA``) shipped in site-packages.

A missing folder (a machine without manual pages) gives an empty source,
which `public_corpus_documents` reports and skips; a corpus with no text at
all is refused.

Held out: the docstrings of `HELD_OUT_PACKAGES` (scipy, scikit-learn,
matplotlib) are never read, nor any file their distributions installed, and
any paragraph of 80 characters or more that also occurs in one of their
docstrings is dropped from every source (a package may copy a docstring).
The fine-tuning task classifies those docstrings: they stay out of
pretraining.

Every source is deterministic for an installation: files are visited in an
order fixed by their paths (a hash, so that a size cap takes an even sample
of the files rather than the first letters of the alphabet), paragraphs are
de-duplicated across each source in that order, and the text read is cached
under the corpus cache, keyed by the name, size and modification time of
every file the source may read (`source_fingerprint`).
"""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import html.parser
import importlib.metadata
import json
import lzma
import os
import re
import sysconfig
from typing import Callable, Iterable, Iterator, Sequence

from tf_megadp.jobs.bert.corpus import (
    DEFAULT_PACKAGES,
    HELD_OUT_DISTRIBUTIONS,
    HELD_OUT_PACKAGES,
    SKIPPED_FOLDERS,
    CorpusError,
    default_corpus_documents,
    file_docstrings,
)

__all__ = ["PUBLIC_SOURCES", "SourceRoots", "held_out_files", "held_out_paragraphs",
           "html_paragraphs", "is_prose", "markup_paragraphs", "parse_public_sources",
           "prose_paragraphs", "public_corpus_documents", "read_source", "roff_paragraphs",
           "source_files", "source_fingerprint", "sources_fingerprint"]

# The public sources, by name, with what each holds (for reports and --help).
PUBLIC_SOURCES = {
    "docstrings": "docstrings of " + ", ".join(DEFAULT_PACKAGES),
    "more-docstrings": "docstrings of the other installed Python packages",
    "man": "English manual pages (/usr/share/man/man1-8)",
    "doc": "text documentation under /usr/share/doc (README, NEWS, FAQ, .txt, .md, .rst, .html)",
    "package-docs": ".md, .rst and .txt files and package descriptions in site-packages",
}
# Bump when a reader changes what it returns: the cached text is then read again.
_READER_VERSION = 2
# A paragraph shorter than this is never compared with the held-out text
# (a shared "Input array." is English, not a copied docstring).
HELD_OUT_MIN_CHARACTERS = 80
_MIN_PARAGRAPH_CHARACTERS = 40
_MIN_PARAGRAPH_WORDS = 6
# Longer "paragraphs" are listings run together (a table of glyph names, a
# file without blank lines), not prose.
_MAX_PARAGRAPH_CHARACTERS = 4000
# Share of a paragraph's whitespace-separated tokens that must be words.
_MIN_WORD_SHARE = 0.7
_WORD = re.compile(r"^[\"'(\[`*_]*[A-Za-z][A-Za-z'\u2019-]*[\"')\]`*_]*[.,;:!?]*[\"')\]]*$")

Progress = Callable[[str], None]


class SourceRoots:
    """Where the sources are read (tests point them at small fixtures).

    Args:
        man: manual-page roots (each holding man1 ... man8).
        doc: documentation roots (each holding one folder per package).
        site_packages: the site-packages folders of "more-docstrings" and
            "package-docs" (default: this interpreter's purelib and platlib).
        stdlib: the standard library (for "docstrings").
        held_out: folders holding the held-out packages' code, and the
            files their distributions installed (default: found with
            importlib; see `held_out_files`).
    """

    def __init__(self, man: Sequence[str] = ("/usr/share/man",),
                 doc: Sequence[str] = ("/usr/share/doc",),
                 site_packages: Sequence[str] | None = None,
                 held_out: Sequence[str] | None = None):
        self.man = tuple(man)
        self.doc = tuple(doc)
        if site_packages is None:
            paths = sysconfig.get_paths()
            site_packages = sorted({paths["purelib"], paths["platlib"]})
        self.site_packages = tuple(site_packages)
        self.held_out = None if held_out is None else tuple(held_out)

    def key(self) -> list:
        return [list(self.man), list(self.doc), list(self.site_packages),
                None if self.held_out is None else list(self.held_out)]


def parse_public_sources(text: str | Sequence[str]) -> tuple[str, ...]:
    """"docstrings,man" (or a list of names) -> ("docstrings", "man"), checked.

    Raises:
        CorpusError: no name, an unknown name (the known ones are listed),
            or a name given twice.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    if not names:
        raise CorpusError(f"name at least one public source among {', '.join(PUBLIC_SOURCES)}.")
    unknown = [n for n in names if n not in PUBLIC_SOURCES]
    if unknown:
        raise CorpusError(f"unknown public source(s) {', '.join(unknown)}; choose among "
                          f"{', '.join(PUBLIC_SOURCES)} (comma-separated).")
    if len(set(names)) != len(names):
        raise CorpusError(f"a public source is named twice in {','.join(names)}.")
    return tuple(names)


# -- Held-out packages ---------------------------------------------------------------


def held_out_files(roots: SourceRoots | None = None) -> tuple[set[str], list[str]]:
    """(files the held-out distributions installed, their package folders), absolute paths.

    The folders are those of `HELD_OUT_PACKAGES` and of every top-level
    package or module their distributions install (matplotlib also installs
    mpl_toolkits and pylab). A package that is not installed adds nothing.
    """
    roots = roots or SourceRoots()
    files: set[str] = set()
    folders: list[str] = []
    if roots.held_out is not None:
        for folder in roots.held_out:
            folders.append(os.path.abspath(folder))
        return files, folders
    for name in HELD_OUT_DISTRIBUTIONS:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for entry in distribution.files or ():
            path = os.path.abspath(str(distribution.locate_file(entry)))
            files.add(path)
            parts = entry.parts
            top = parts[0] if parts else ""
            if len(parts) > 1 and not top.endswith((".dist-info", ".libs", ".data")) \
                    and top != "__pycache__" and not top.startswith(".."):
                folders.append(os.path.abspath(str(distribution.locate_file(top))))
    for package in HELD_OUT_PACKAGES:
        for site in roots.site_packages:
            candidate = os.path.join(site, package)
            if os.path.isdir(candidate):
                folders.append(os.path.abspath(candidate))
    return files, sorted(set(folders))


def _inside(path: str, folders: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    return any(path == folder or path.startswith(folder + os.sep) for folder in folders)


def _normalized(text: str) -> str:
    return " ".join(text.split())


def _key(text: str) -> bytes:
    return hashlib.sha1(_normalized(text).encode("utf-8")).digest()


# Release-channel words that tell variants of one page apart ("gcloud alpha
# compute ...", "(BETA) Lists ..."): ignored when paragraphs are de-duplicated.
_CHANNEL_WORDS = re.compile(r"\(?\b(alpha|beta|preview)\b\)?", re.I)


def _near_key(text: str) -> bytes:
    """A paragraph's key for de-duplication: case, punctuation and release channel ignored."""
    text = _CHANNEL_WORDS.sub(" ", text.lower())
    return hashlib.sha1(" ".join(re.findall(r"[a-z0-9]+", text)).encode("utf-8")).digest()


def _python_files(root: str) -> Iterator[str]:
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def held_out_paragraphs(roots: SourceRoots | None = None) -> set[bytes]:
    """Keys of the held-out docstrings' paragraphs of `HELD_OUT_MIN_CHARACTERS` or more.

    Also the key of each whole docstring: a public text equal to one is
    dropped whatever its length.
    """
    _, folders = held_out_files(roots)
    keys: set[bytes] = set()
    for folder in folders:
        for path in _python_files(folder):
            for text in file_docstrings(path):
                keys.add(_key(text))
                for paragraph in _split_blank_lines(text):
                    if len(_normalized(paragraph)) >= HELD_OUT_MIN_CHARACTERS:
                        keys.add(_key(paragraph))
    return keys


def _without_held_out(text: str, held_out: set[bytes]) -> str:
    """`text` without its paragraphs that are held-out text ("" if it is one)."""
    if _key(text) in held_out:
        return ""
    kept = [paragraph for paragraph in _split_blank_lines(text)
            if len(_normalized(paragraph)) < HELD_OUT_MIN_CHARACTERS
            or _key(paragraph) not in held_out]
    return "\n\n".join(kept).strip()


# -- Prose ---------------------------------------------------------------------------


_BLANK_LINES = re.compile(r"\n[ \t]*\n")


def _split_blank_lines(text: str) -> list[str]:
    return [part.strip() for part in _BLANK_LINES.split(text) if part.strip()]


def is_prose(paragraph: str) -> bool:
    """Whether a paragraph reads as English sentences, not a listing, code or a table.

    At least `_MIN_PARAGRAPH_WORDS` tokens and `_MIN_PARAGRAPH_CHARACTERS`
    characters (at most `_MAX_PARAGRAPH_CHARACTERS`), of which
    `_MIN_WORD_SHARE` are words of Latin letters (with their punctuation).
    """
    if not _MIN_PARAGRAPH_CHARACTERS <= len(paragraph) <= _MAX_PARAGRAPH_CHARACTERS:
        return False
    tokens = paragraph.split()
    if len(tokens) < _MIN_PARAGRAPH_WORDS:
        return False
    words = sum(1 for token in tokens if _WORD.match(token))
    return words >= _MIN_WORD_SHARE * len(tokens)


def prose_paragraphs(paragraphs: Iterable[str]) -> list[str]:
    """The paragraphs that are prose (`is_prose`), whitespace normalised."""
    return [_normalized(p) for p in paragraphs if is_prose(_normalized(p))]


# -- roff (manual pages) -------------------------------------------------------------

# Macros that start a new paragraph (man and mdoc).
_BREAKS = {"PP", "P", "LP", "SH", "SS", "TP", "IP", "HP", "sp", "br", "Pp", "Sh", "Ss", "It",
           "Bl", "El", "TQ", "RS", "RE", "in", "ti", "bp", "Lp", "Nd", "D1", "Dl", "Bd", "Ed"}
# Fonts of their arguments: the words joined by spaces (B, I) or without (BR ...).
_SPACED = {"B", "I", "SM", "SB", "Nm", "Nd", "Em", "Sy", "Li", "Ar", "Pa", "Cm", "Ic", "Va",
           "Ev", "Dv", "Er", "Fn", "Ft", "Fa", "Dq", "Ql", "Sq", "Pq", "Qq", "Xr", "Fl",
           "Op", "Oo", "Oc", "Aq", "Bq", "Brq", "D1", "Dl", "UR", "MT", "Lk", "Mt", "Ad",
           "An", "Cd", "Ms", "Sx", "St", "Tn", "Ux", "At", "Bx", "Nx", "Fx", "Ox", "Dx",
           "Bsx", "Lb", "In", "Vt", "Dt", "Os", "Ta", "Eo", "Ec", "Do", "Dc", "Qo", "Qc",
           "Po", "Pc", "So", "Sc", "Xo", "Xc", "Ns", "No", "Ic", "Pf", "Ap", "%A", "%T"}
_ALTERNATING = {"BR", "RB", "IR", "RI", "BI", "IB"}
# mdoc's callable macro names inside a line's arguments (dropped, their words kept).
_MDOC_CALLABLE = _SPACED - {"B", "I", "SM", "SB", "UR", "MT"}
# Blocks whose lines are not prose: literal text, tables, pictures, equations.
_SKIP_BLOCKS = {"nf": "fi", "EX": "EE", "TS": "TE", "PS": "PE", "EQ": "EN", "de": "..",
                "ig": "..", "am": ".."}
# Sections without prose.
_SKIPPED_SECTIONS = {"SYNOPSIS", "SEE ALSO", "SYNTAX"}
_SPECIAL_CHARACTERS = {
    "em": "\u2014", "en": "\u2013", "hy": "-", "mi": "-", "aq": "'", "dq": '"', "lq": '"',
    "rq": '"', "oq": "'", "cq": "'", "bu": "\u2022", "co": "\u00a9", "rg": "\u00ae",
    "tm": "\u2122", "ti": "~", "ha": "^", "pl": "+", "mu": "\u00d7", "di": "\u00f7",
    ">=": ">=", "<=": "<=", "!=": "!=", "->": "->", "<-": "<-", "ga": "`", "aa": "'",
    "rs": "\\", "sl": "/", "ba": "|", "or": "|", "at": "@", "sh": "#", "Do": "$", "dg": "+",
    "fm": "'", "de": "\u00b0", "ua": "^", "da": "v", "lh": "", "rh": "", "ss": "ss",
}
_STRINGS = {"lq": '"', "rq": '"', "R": "(R)", "Tm": "(TM)", "Aq": "'", "C+": "C++",
            "L\"": '"', "R\"": '"', "C`": '"', "C'": '"', "PI": "pi"}
_ESCAPE = re.compile(
    r"\\(?:"
    r"f(?:\[[^\]]*\]|\(..|.)"           # font
    r"|s(?:[+-]?\d|\(\d\d|\[[^\]]*\])?"  # size
    r"|[nkgmM](?:\[[^\]]*\]|\(..|.)"     # registers, colours
    r"|[hvwlLoXDbxNRSZCYAB]'[^']*'"      # escapes with a quoted argument
    r"|[hvwlLoXDbxNRSZCYAB]\[[^\]]*\]"
    r"|\*(?:\[[^\]]*\]|\(..|.)"          # strings
    r"|\((..)"                           # special characters \(xx
    r"|\[([^\]]*)\]"                     # special characters \[xx]
    r"|(.)"                              # one character
    r")", re.S)


def _escape(match: re.Match) -> str:
    text = match.group(0)
    if text.startswith("\\*"):
        name = text[2:].strip("[]")
        if name.startswith("("):
            name = name[1:]
        return _STRINGS.get(name, "")
    if match.group(1) is not None:
        return _SPECIAL_CHARACTERS.get(match.group(1), "")
    if match.group(2) is not None:
        return _SPECIAL_CHARACTERS.get(match.group(2), "")
    single = match.group(3)
    if single is None:
        return ""  # fonts, sizes, registers, motions
    return {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "'",
            "`": "`", ".": ".", "_": "_", "t": " ", "E": "\\", "@": "@", "!": "",
            "|": "", "^": "", "&": "", ")": "", "/": "", ",": "", "%": "", "c": "",
            ":": "", "{": "", "}": "", "p": "", "a": "", "d": "", "u": "", "r": "",
            "z": "", "\n": ""}.get(single, "")


def _roff_text(line: str) -> str:
    """A roff text line without comments and escapes."""
    comment = re.search(r'\\"', line)
    if comment:
        line = line[:comment.start()]
    line = re.sub(r"\\#.*$", "", line)
    return _ESCAPE.sub(_escape, line)


def _arguments(text: str) -> list[str]:
    """A request's arguments: words, or double-quoted strings."""
    arguments, index = [], 0
    while index < len(text):
        if text[index].isspace():
            index += 1
            continue
        if text[index] == '"':
            end = text.find('"', index + 1)
            while end != -1 and end + 1 < len(text) and text[end + 1] == '"':
                end = text.find('"', end + 2)  # "" is a quote inside a quoted argument
            end = len(text) if end == -1 else end
            arguments.append(text[index + 1:end].replace('""', '"'))
            index = end + 1
        else:
            end = index
            while end < len(text) and not text[end].isspace():
                end += 1
            arguments.append(text[index:end])
            index = end
    return arguments


def roff_paragraphs(source: str) -> list[str]:
    """The paragraphs of a manual page written in roff (man or mdoc macros), as plain text.

    Text lines of a paragraph are joined with spaces; a paragraph macro, a
    section heading, a tag (.TP, .IP), .br, .sp or a blank line ends it.
    Font, size and motion escapes are dropped, special characters become
    their characters. Literal blocks (.nf/.fi, .EX/.EE), tables, equations,
    macro definitions, conditionals and the SYNOPSIS and SEE ALSO sections
    are left out. A page that is only a link to another (.so) has none.

    Args:
        source: the page's text.

    Returns:
        The paragraphs, whitespace normalised, headings and tags among them
        (`prose_paragraphs` keeps the prose).

    Example:
    ```python
    roff_paragraphs('.TH LS 1\\n.SH DESCRIPTION\\nList \\\\fBfiles\\\\fR.\\n')
    # ['DESCRIPTION', 'List files.']
    ```
    """
    paragraphs: list[str] = []
    current: list[str] = []
    section = ""
    page_name = ""  # mdoc: .Nm without an argument names the page
    skip_until: str | None = None
    brace_depth = 0
    tag_next = False  # after .TP: the next line of text is the tag

    def flush() -> None:
        nonlocal tag_next
        tag_next = False
        if current:
            text = _normalized(" ".join(current))
            if text and section not in _SKIPPED_SECTIONS:
                paragraphs.append(text)
            current.clear()

    def text_line(text: str) -> None:
        current.append(text)
        if tag_next:
            flush()  # The tag of a .TP paragraph, then its body.

    lines = source.replace("\r\n", "\n").split("\n")
    # Continuation lines: a line ending in a backslash goes on with the next.
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\") and not joined[-1].endswith("\\\\"):
            joined[-1] = joined[-1][:-1] + line
        else:
            joined.append(line)
    for line in joined:
        if brace_depth:
            brace_depth += line.count("\\{") - line.count("\\}")
            brace_depth = max(brace_depth, 0)
            continue
        stripped = line.strip()
        if skip_until is not None:
            if stripped.startswith(("." + skip_until, "'" + skip_until)) or (
                    skip_until == ".." and stripped == ".."):
                skip_until = None
            continue
        if not stripped:
            flush()
            continue
        if stripped[0] in ".'":
            request = stripped[1:].lstrip()
            if request.startswith('\\"') or not request:
                continue
            name, _, rest = request.partition(" ")
            name = name.strip()
            rest = rest.strip()
            if name == "so":
                return []  # A link to another page, read there.
            if name in _SKIP_BLOCKS:
                flush()
                skip_until = _SKIP_BLOCKS[name]
                continue
            if name == "Bd" and "-literal" in rest or name == "Bd" and "-unfilled" in rest:
                flush()
                skip_until = "Ed"
                continue
            if name in ("if", "ie", "el", "while"):
                brace_depth += request.count("\\{") - request.count("\\}")
                continue
            if name in ("SH", "Sh", "SS", "Ss"):
                flush()
                heading = _normalized(_roff_text(" ".join(_arguments(rest))))
                if name in ("SH", "Sh"):
                    section = heading.upper()
                if section not in _SKIPPED_SECTIONS and heading:
                    paragraphs.append(heading)
                continue
            if name in _BREAKS:
                flush()
                tag_next = name in ("TP", "TQ")
                if name == "IP":
                    tag = _arguments(rest)
                    if tag:
                        current.append(_roff_text(tag[0]))
                        flush()
                elif name in ("It", "D1", "Dl", "Nd") and rest:
                    current.append(_mdoc_words(rest))
                    if name == "It":
                        flush()
                continue
            if name in _ALTERNATING:
                text_line("".join(_roff_text(a) for a in _arguments(rest)))
                continue
            if name == "Nm":
                page_name = page_name or _mdoc_words(rest)
                text_line(_mdoc_words(rest) or page_name)
                continue
            if name in _SPACED:
                if name in _MDOC_CALLABLE:
                    text_line(_mdoc_words(rest))
                else:
                    text_line(" ".join(_roff_text(a) for a in _arguments(rest)))
                continue
            continue  # Any other request: layout, not text.
        text_line(_roff_text(line))
    flush()
    return [p for p in paragraphs if p]


def _mdoc_words(rest: str) -> str:
    """An mdoc line's words without its callable macro names; punctuation kept tight."""
    words = [a for a in _arguments(rest) if a not in _MDOC_CALLABLE]
    text = " ".join(_roff_text(w) for w in words)
    return re.sub(r" ([.,;:)\]])", r"\1", text)


# -- Markup (text, markdown, reST, HTML) ---------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+\u2022]|\d+[.)])\s+")
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+_])\1{2,}\s*$")
_MARKDOWN_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_REST_ROLE = re.compile(r":[\w:.-]+:`([^`<]*?)(?:\s*<[^>]*>)?`")
_TAG = re.compile(r"<[^>]{0,200}>")


def markup_paragraphs(text: str) -> list[str]:
    """Paragraphs of a plain-text, markdown or reStructuredText file, markup removed.

    Blank lines, headings, list items and section underlines end a
    paragraph; fenced and indented code blocks, reST directives and literal
    blocks (after "::"), and tables are left out; links keep their text,
    roles and inline code their words.
    """
    paragraphs: list[str] = []
    current: list[str] = []
    in_fence = False
    literal_indent: int | None = None

    def flush() -> None:
        if current:
            paragraphs.append(_normalized(" ".join(current)))
            current.clear()

    for raw in text.replace("\r\n", "\n").split("\n"):
        line = raw.rstrip()
        if _FENCE.match(line):
            flush()
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if not line.strip() or indent > literal_indent:
                continue
            literal_indent = None
        if not line.strip():
            flush()
            continue
        stripped = line.strip()
        if stripped.startswith(".. ") or stripped == "..":
            flush()
            literal_indent = indent
            continue
        if _UNDERLINE.match(line) or stripped.startswith(("|", "+--", "+==")):
            flush()
            continue
        if indent >= 4 and not current:
            continue  # Indented code.
        if stripped.startswith("#"):
            flush()
            paragraphs.append(_normalized(stripped.lstrip("#")))
            continue
        if _LIST_ITEM.match(line):
            flush()
            stripped = _LIST_ITEM.sub("", line)
        if stripped.endswith("::"):
            current.append(stripped[:-1])
            flush()
            literal_indent = indent
            continue
        current.append(stripped)
    flush()
    cleaned = []
    for paragraph in paragraphs:
        paragraph = _MARKDOWN_LINK.sub(r"\1", paragraph)
        paragraph = _REST_ROLE.sub(r"\1", paragraph)
        paragraph = _TAG.sub(" ", paragraph)
        paragraph = paragraph.replace("``", "").replace("**", "")
        paragraph = _normalized(paragraph)
        if paragraph:
            cleaned.append(paragraph)
    return cleaned


class _HtmlText(html.parser.HTMLParser):
    _BLOCKS = {"p", "div", "li", "ul", "ol", "dd", "dt", "dl", "br", "tr", "td", "th", "table",
               "section", "article", "header", "footer", "blockquote", "h1", "h2", "h3", "h4",
               "h5", "h6", "hr", "body", "nav", "aside", "main", "figure", "figcaption"}
    _HIDDEN = {"script", "style", "pre", "head", "title", "nav", "svg", "template"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.current: list[str] = []
        self.hidden = 0

    def flush(self) -> None:
        if self.current:
            self.paragraphs.append(_normalized("".join(self.current)))
            self.current.clear()

    def handle_starttag(self, tag, attrs):
        if tag in self._HIDDEN:
            self.hidden += 1
        if tag in self._BLOCKS or tag in self._HIDDEN:
            self.flush()

    def handle_endtag(self, tag):
        if tag in self._HIDDEN and self.hidden:
            self.hidden -= 1
        if tag in self._BLOCKS or tag in self._HIDDEN:
            self.flush()

    def handle_data(self, data):
        if not self.hidden:
            self.current.append(data)


def html_paragraphs(text: str) -> list[str]:
    """The text of an HTML page's block elements; scripts, styles, <pre> and <head> left out."""
    parser = _HtmlText()
    try:
        parser.feed(text)
        parser.close()
    except (AssertionError, ValueError):
        pass  # Malformed markup: keep what was read.
    parser.flush()
    return [p for p in parser.paragraphs if p]


# -- Files ---------------------------------------------------------------------------

_COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".lzma": lzma.open}
# Files that can be a few hundred MB when decompressed are not worth it.
_MAX_FILE_BYTES = 8 << 20


def _read_text(path: str) -> str | None:
    """A file's text, decompressed (gzip, bzip2, xz) and decoded (UTF-8, else Latin-1)."""
    _, extension = os.path.splitext(path)
    opener = _COMPRESSED.get(extension, open)
    try:
        with opener(path, "rb") as handle:
            data = handle.read(_MAX_FILE_BYTES + 1)
    except (OSError, EOFError, lzma.LZMAError):
        return None
    if len(data) > _MAX_FILE_BYTES or b"\0" in data[:4096]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _base_name(path: str) -> str:
    """The file name without a compression suffix."""
    name = os.path.basename(path)
    stem, extension = os.path.splitext(name)
    return stem if extension in _COMPRESSED else name


def _spread(paths: Iterable[str], root: str) -> list[str]:
    """Paths in an order fixed by their names but spread over the alphabet."""
    return sorted(paths, key=lambda p: hashlib.sha1(
        os.path.relpath(p, root).encode("utf-8", "surrogateescape")).digest())


def _man_files(roots: SourceRoots) -> list[str]:
    files = []
    for root in roots.man:
        for section in range(1, 9):
            folder = os.path.join(root, f"man{section}")
            if not os.path.isdir(folder):
                continue
            found = [os.path.join(folder, name) for name in os.listdir(folder)]
            # A symbolic link names a page read under its own name.
            files.extend(_spread([p for p in found if os.path.isfile(p)
                                  and not os.path.islink(p)], root))
    return files


_DOC_NAMES = re.compile(r"^(README|NEWS|FAQ|TODO|USAGE|HOWTO|INSTALL)([._-].*)?$", re.I)
_DOC_EXTENSIONS = (".txt", ".md", ".rst", ".html", ".htm", ".markdown", ".text")
_NOT_DOCS = re.compile(r"(copyright|licen[cs]e|copying|changelog|changes|authors|thanks|"
                       r"credits|contributors|notice|patents)", re.I)


def _is_doc(name: str) -> bool:
    return bool(_DOC_NAMES.match(name) or name.lower().endswith(_DOC_EXTENSIONS)) \
        and not _NOT_DOCS.search(name)


def _held_out_name(path: str) -> bool:
    """A documentation folder of a held-out package (python3-scipy, python-matplotlib-doc, ...)."""
    parts = re.split(r"[-_./]", path.lower())
    return any(name in parts for name in HELD_OUT_PACKAGES + tuple(
        d.lower() for d in HELD_OUT_DISTRIBUTIONS)) or "scikit" in parts


def _doc_files(roots: SourceRoots) -> list[str]:
    files = []
    for root in roots.doc:
        found = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders
                                   if not _held_out_name(d) and not _NOT_DOCS.search(d))
            for name in sorted(names):
                path = os.path.join(folder, name)
                if _is_doc(_base_name(path)) and os.path.isfile(path) \
                        and not os.path.islink(path):
                    found.append(path)
        files.extend(_spread(found, root))
    return files


def _site_entries(roots: SourceRoots) -> list[tuple[str, str]]:
    """(site-packages folder, top-level entry) of the installed packages, held-out ones excepted."""
    import tf_megadp

    _, held_folders = held_out_files(roots)
    own = os.path.dirname(os.path.abspath(tf_megadp.__file__))
    entries = []
    for site in roots.site_packages:
        if not os.path.isdir(site):
            continue
        for name in sorted(os.listdir(site)):
            path = os.path.join(site, name)
            if name.startswith(("_", ".")) or name in SKIPPED_FOLDERS \
                    or _inside(path, held_folders) or os.path.abspath(path) == own:
                continue
            entries.append((site, name))
    return entries


def _more_docstring_files(roots: SourceRoots) -> list[str]:
    held_files, held_folders = held_out_files(roots)
    found = []
    for site, name in _site_entries(roots):
        path = os.path.join(site, name)
        if name in DEFAULT_PACKAGES or name.endswith((".dist-info", ".egg-info", ".libs")):
            continue
        if os.path.isdir(path):
            found.extend(p for p in _python_files(path)
                         if p not in held_files and not _inside(p, held_folders))
        elif name.endswith(".py") and path not in held_files:
            found.append(path)
    return _spread(found, "/") if found else []


def _package_doc_files(roots: SourceRoots) -> list[str]:
    held_files, held_folders = held_out_files(roots)
    found = []
    for site, name in _site_entries(roots):
        path = os.path.join(site, name)
        if name.endswith(".dist-info"):
            distribution = name[:-len(".dist-info")].rsplit("-", 1)[0].lower().replace("_", "-")
            if distribution in {d.lower() for d in HELD_OUT_DISTRIBUTIONS}:
                continue
            metadata = os.path.join(path, "METADATA")
            if os.path.isfile(metadata):
                found.append(metadata)
            continue
        if not os.path.isdir(path):
            continue
        for folder, subfolders, names in os.walk(path):
            subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
            for file_name in sorted(names):
                candidate = os.path.join(folder, file_name)
                if file_name.lower().endswith((".md", ".rst", ".txt")) \
                        and not _NOT_DOCS.search(file_name) and candidate not in held_files \
                        and not _inside(candidate, held_folders):
                    found.append(candidate)
    return _spread(found, "/") if found else []


def source_files(source: str, roots: SourceRoots | None = None) -> list[str]:
    """The files a source reads, in the order it reads them.

    Raises:
        CorpusError: an unknown source name.
    """
    roots = roots or SourceRoots()
    if source == "docstrings":
        from tf_megadp.jobs.bert.corpus import package_roots

        return [p for root in package_roots(DEFAULT_PACKAGES) for p in _python_files(root)]
    listers = {"more-docstrings": _more_docstring_files, "man": _man_files,
               "doc": _doc_files, "package-docs": _package_doc_files}
    if source not in listers:
        raise CorpusError(
            f"Unknown public source {source!r}; choose among {', '.join(PUBLIC_SOURCES)}.")
    return listers[source](roots)


def source_fingerprint(source: str, roots: SourceRoots | None = None) -> str:
    """A digest of what a source reads: every file's name, size and modification time.

    Also the held-out packages' files (what is filtered out) and the
    reader's version. Installing, removing or upgrading a package (or a
    manual page) changes it.
    """
    roots = roots or SourceRoots()
    digest = hashlib.sha256(json.dumps(
        {"source": source, "reader": _READER_VERSION, "roots": roots.key(),
         "held_out": list(HELD_OUT_PACKAGES)}).encode("utf-8"))
    _, held_folders = held_out_files(roots)
    paths = source_files(source, roots) + [
        p for folder in held_folders for p in _python_files(folder)]
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            continue
        digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode(
            "utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


# -- Reading a source ----------------------------------------------------------------


def _page_documents(paths: Sequence[str], paragraphs_of: Callable[[str, str], list[str]],
                    held_out: set[bytes], progress: Progress | None, what: str) -> list[str]:
    """One document per file: its prose paragraphs not seen before in this source.

    "Seen" ignores case, punctuation and the words alpha, beta and preview
    (`_near_key`): the alpha and beta variants of a command's page repeat
    its paragraphs.
    """
    seen: set[bytes] = set()
    documents = []
    for index, path in enumerate(paths):
        text = _read_text(path)
        if text is None:
            continue
        kept = []
        for paragraph in prose_paragraphs(paragraphs_of(path, text)):
            if len(paragraph) >= HELD_OUT_MIN_CHARACTERS and _key(paragraph) in held_out:
                continue
            key = _near_key(paragraph)
            if key in seen:
                continue
            seen.add(key)
            kept.append(paragraph)
        if kept:
            documents.append("\n\n".join(kept))
        if progress and (index + 1) % 2000 == 0:
            progress(f"  {what}: {index + 1:,} / {len(paths):,} files, "
                     f"{len(documents):,} documents")
    return documents


def _markup_of(path: str, text: str) -> list[str]:
    name = _base_name(path).lower()
    if name.endswith((".html", ".htm")):
        return html_paragraphs(text)
    if os.path.basename(path) == "METADATA":
        # Headers, then a blank line, then the package's description.
        _, _, body = text.partition("\n\n")
        return markup_paragraphs(body)
    return markup_paragraphs(text)


def _docstring_documents(paths: Sequence[str], held_out: set[bytes]) -> list[str]:
    seen: set[bytes] = set()
    documents = []
    for path in paths:
        for text in file_docstrings(path):
            key = _key(text)
            if key in seen:
                continue
            seen.add(key)
            text = _without_held_out(text, held_out)
            if text:
                documents.append(text)
    return documents


def read_source(source: str, roots: SourceRoots | None = None, *,
                held_out: set[bytes] | None = None,
                progress: Progress | None = None) -> list[str]:
    """Every document of one public source, held-out text removed.

    "docstrings" is not read here (`public_corpus_documents` reads it with
    its per-package budget, as the job always has).

    Args:
        source: a name of `PUBLIC_SOURCES` other than "docstrings".
        roots: where to read (default: this machine's folders).
        held_out: `held_out_paragraphs(roots)`, if already computed.
        progress: called with a line every 2,000 files.

    Returns:
        The documents, in the source's order.
    """
    roots = roots or SourceRoots()
    if held_out is None:
        held_out = held_out_paragraphs(roots)
    paths = source_files(source, roots)
    if source == "more-docstrings":
        return _docstring_documents(paths, held_out)
    if source == "man":
        return _page_documents(paths, lambda _, text: roff_paragraphs(text), held_out,
                               progress, "manual pages")
    if source in ("doc", "package-docs"):
        return _page_documents(paths, _markup_of, held_out, progress, source)
    raise CorpusError(f"read_source does not read {source!r}; use public_corpus_documents.")


def _cached(path: str, build: Callable[[], object]):
    """JSON at `path`, built (and written atomically) if missing."""
    from tf_megadp.files import write_bytes_atomically

    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError, EOFError):
        pass
    value = build()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_bytes_atomically(path, gzip.compress(json.dumps(value).encode("utf-8"), mtime=0))
    return value


def _water_fill(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Equal shares of `total`; a source smaller than its share gives the rest to the others."""
    shares: dict[str, int] = {}
    pending = dict(sizes)
    remaining = total
    while pending:
        share = remaining // len(pending)
        small = {name: size for name, size in pending.items() if size <= share}
        if not small:
            shares.update({name: share for name in pending})
            break
        for name, size in small.items():
            shares[name] = size
            remaining -= size
            del pending[name]
    return shares


def _prefix(documents: Sequence[str], budget: int) -> list[str]:
    taken, used = [], 0
    for document in documents:
        if used >= budget:
            break
        taken.append(document)
        used += len(document)
    return taken


def public_corpus_documents(
    sources: Sequence[str],
    max_characters: int,
    *,
    cache_dir: str | None = None,
    roots: SourceRoots | None = None,
    progress: Progress | None = None,
    sizes: dict[str, dict[str, int]] | None = None,
) -> list[str]:
    """The public corpus: documents of the given sources, up to `max_characters` in all.

    Every source gets an equal share of `max_characters`; a source with less
    text gives the rest of its share to the others. Within "docstrings" the
    share is split over its packages as `default_corpus_documents` does;
    other sources give their documents in their (spread) file order.

    Args:
        sources: names of `PUBLIC_SOURCES`.
        max_characters: the corpus's size cap.
        cache_dir: where each source's text is cached (keyed by
            `source_fingerprint`); None reads every time.
        roots: where to read (default: this machine's folders).
        progress: called with one line per source.
        sizes: filled with each source's {"available": characters it has,
            "documents": documents taken, "characters": characters taken}.

    Returns:
        The documents, source after source.

    Raises:
        CorpusError: an unknown source, a duplicate, or no text at all.
    """
    sources = parse_public_sources(sources)
    if isinstance(max_characters, bool) or not isinstance(max_characters, int) \
            or max_characters < 1:
        raise CorpusError(f"max_characters must be a positive integer, got {max_characters!r}.")
    roots = roots or SourceRoots()
    held: set[bytes] | None = None

    def held_out() -> set[bytes]:
        nonlocal held
        if held is None:
            if cache_dir is None:
                held = held_out_paragraphs(roots)
            else:
                folder_key = _held_out_fingerprint(roots)
                keys = _cached(os.path.join(cache_dir, "public-text",
                                            f"held-out-{folder_key}.json.gz"),
                               lambda: sorted(k.hex() for k in held_out_paragraphs(roots)))
                held = {bytes.fromhex(k) for k in keys}
        return held

    def docstrings(budget: int) -> list[str]:
        return [text for text in (_without_held_out(t, held_out()) for t in
                                  default_corpus_documents(max(1, budget), DEFAULT_PACKAGES))
                if text]

    full: dict[str, list[str]] = {}
    available: dict[str, int] = {}
    for source in sources:
        if source == "docstrings" and cache_dir is None:
            documents = docstrings(max_characters)
        elif source == "docstrings":
            path = os.path.join(cache_dir, "public-text", f"docstrings-{max_characters}-"
                                f"{source_fingerprint(source, roots)}.json.gz")
            documents = _cached(path, lambda: docstrings(max_characters))
        elif cache_dir is None:
            documents = read_source(source, roots, held_out=held_out(), progress=progress)
        else:
            path = os.path.join(cache_dir, "public-text",
                                f"{source}-{source_fingerprint(source, roots)}.json.gz")
            documents = _cached(path, lambda: read_source(source, roots, held_out=held_out(),
                                                          progress=progress))
        full[source] = documents
        available[source] = sum(len(d) for d in documents)
        if progress:
            progress(f"  public source {source}: {len(documents):,} documents, "
                     f"{available[source]:,} characters available")
    shares = _water_fill(available, max_characters)
    corpus: list[str] = []
    for source in sources:
        if source == "docstrings" and shares[source] < available[source]:
            # Its own split of the share over the packages, as the job's default corpus.
            taken = docstrings(shares[source])
        elif source == "docstrings":
            taken = full[source]
        else:
            taken = _prefix(full[source], shares[source])
        if sizes is not None:
            sizes[source] = {"available": available[source], "documents": len(taken),
                             "characters": sum(len(d) for d in taken)}
        corpus.extend(taken)
    if not corpus:
        raise CorpusError(
            f"The public sources {list(sources)} hold no text on this machine (no manual "
            "pages or documentation installed?); add \"docstrings\".")
    return corpus


def sources_fingerprint(sources: Sequence[str], roots: SourceRoots | None = None) -> list:
    """[(source, `source_fingerprint`), ...]: what a public corpus of these sources depends on.

    Computed once per process for this machine's folders (a few seconds of
    `os.stat` over the manual pages and site-packages).
    """
    if roots is None:
        return [(source, _machine_fingerprint(source)) for source in parse_public_sources(sources)]
    return [(source, source_fingerprint(source, roots)) for source in parse_public_sources(sources)]


@functools.lru_cache(maxsize=None)
def _machine_fingerprint(source: str) -> str:
    return source_fingerprint(source, SourceRoots())


def _held_out_fingerprint(roots: SourceRoots) -> str:
    _, folders = held_out_files(roots)
    digest = hashlib.sha256(json.dumps({"reader": _READER_VERSION,
                                        "folders": folders}).encode("utf-8"))
    for folder in folders:
        for path in _python_files(folder):
            info = os.stat(path)
            digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode(
                "utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]
