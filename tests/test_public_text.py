"""Specification of tf_megadp.jobs.bert.public_text: the public corpus's sources, source by source.

Every fixture is written here (made-up roff, markdown, HTML and Python), so no
third-party text is stored; the checks on this machine's own folders only
list files, they never read a whole source.
"""

import gzip
import os

import pytest

from tf_megadp.jobs.bert import public_text
from tf_megadp.jobs.bert.corpus import (
    HELD_OUT_DISTRIBUTIONS,
    HELD_OUT_PACKAGES,
    CorpusError,
)
from tf_megadp.jobs.bert.public_text import (
    PUBLIC_SOURCES,
    SourceRoots,
    html_paragraphs,
    is_prose,
    markup_paragraphs,
    parse_public_sources,
    public_corpus_documents,
    read_source,
    roff_paragraphs,
    source_files,
)

SENTENCE = "The sampler draws every example with the same probability at each step."
OTHER = "A private model reads its noisy gradients and never the examples themselves."
COPIED = ("This docstring paragraph is long enough to be compared with the held-out "
          "packages, and one of them holds it word for word.")

MAN_PAGE = r""".\" A comment line that is not text.
.TH FROB 1 "June 2026" "frob 1.0" "User Commands"
.SH NAME
frob \- frobnicate the files
.SH SYNOPSIS
.B frob
[\fIOPTION\fR]... \fIFILE\fR
.SH DESCRIPTION
.B Frob
reads each \fIFILE\fR and writes its \fBfrobnicated\fR form
to the standard output \(em one line at a time.
.PP
Mandatory arguments to long options are mandatory for short options too.
.TP
\fB\-v\fR, \fB\-\-verbose\fR
print a message for every file that it has read and written
.nf
frob \-v a.txt b.txt > out.txt
.fi
.SH "SEE ALSO"
The full documentation for frob is maintained as a manual that nobody reads.
"""

MDOC_PAGE = r""".Dd June 1, 2026
.Dt FROB 1
.Os
.Sh NAME
.Nm frob
.Nd frobnicate the files
.Sh DESCRIPTION
The
.Nm
utility reads every named file and writes a frobnicated copy of it, see
.Xr cat 1 .
"""


def gzipped(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode("utf-8")))


class TestRoff:
    def test_man_macros_give_the_prose_and_leave_out_the_synopsis_and_literal_text(self):
        paragraphs = roff_paragraphs(MAN_PAGE)
        assert "Frob reads each FILE and writes its frobnicated form to the standard output " \
               "\u2014 one line at a time." in paragraphs
        assert "Mandatory arguments to long options are mandatory for short options too." \
            in paragraphs
        # A .TP tag is its own paragraph, its body another.
        assert "-v, --verbose" in paragraphs
        assert "print a message for every file that it has read and written" in paragraphs
        text = " ".join(paragraphs)
        assert "OPTION" not in text            # SYNOPSIS
        assert "a.txt" not in text             # .nf ... .fi
        assert "nobody reads" not in text      # SEE ALSO
        assert "comment" not in text
        assert "\\f" not in text and "\\-" not in text

    def test_mdoc_macros_keep_their_words(self):
        paragraphs = roff_paragraphs(MDOC_PAGE)
        assert ("The frob utility reads every named file and writes a frobnicated copy of "
                "it, see cat 1.") in paragraphs

    def test_a_link_page_has_no_text(self):
        assert roff_paragraphs(".so man1/frob.1\n") == []


class TestMarkup:
    def test_markdown_keeps_prose_and_link_text_not_code(self):
        text = ("# Frob\n\nFrob reads [every file](https://example.org) you give it.\n"
                "It writes them back.\n\n```sh\nfrob -v a.txt\n```\n\n    indented code line\n\n"
                "- a list item that is a sentence of its own.\n- another item\n")
        assert markup_paragraphs(text) == [
            "Frob", "Frob reads every file you give it. It writes them back.",
            "a list item that is a sentence of its own.", "another item"]

    def test_rest_leaves_out_directives_and_literal_blocks(self):
        text = ("Title\n=====\n\nCall :func:`frob` on a file::\n\n    frob(path)\n\n"
                ".. note::\n\n   A directive body.\n\nThe end of the page.\n")
        assert markup_paragraphs(text) == ["Title", "Call frob on a file:",
                                           "The end of the page."]

    def test_html_keeps_block_text_not_scripts_or_preformatted_text(self):
        page = ("<html><head><title>T</title><script>var x = 1;</script></head><body>"
                "<h1>Frob</h1><p>Frob reads <code>files</code> &amp; writes them.</p>"
                "<pre>frob -v a.txt</pre><ul><li>One item.</li></ul></body></html>")
        assert html_paragraphs(page) == ["Frob", "Frob reads files & writes them.", "One item."]


class TestProse:
    def test_a_sentence_is_prose(self):
        assert is_prose(SENTENCE)

    @pytest.mark.parametrize("text", [
        "-a, --all do not ignore entries",                       # too short
        "U+0020 space U+0021 exclam U+0022 quotedbl U+0023 numbersign U+0024 dollar",
        "x = frob(a, b) + 2 * y[3] if z else {k: v for k, v in w}",
        " ".join([SENTENCE] * 80),                               # a listing run together
    ])
    def test_listings_code_and_run_together_tables_are_not(self, text):
        assert not is_prose(text)


def make_tree(root):
    """A machine in miniature: manual pages, documentation, site-packages with a held-out package."""
    man = root / "man"
    gzipped(man / "man1" / "frob.1.gz", MAN_PAGE)
    (man / "man7").mkdir(parents=True)
    (man / "man7" / "plain.7").write_text(
        f".TH PLAIN 7\n.SH DESCRIPTION\n{SENTENCE}\n.PP\n{OTHER}\n")
    # The same paragraph again, in an alpha variant's words: read once.
    (man / "man7" / "plain_alpha.7").write_text(
        f".TH PLAIN 7\n.SH DESCRIPTION\n(ALPHA) {SENTENCE}\n")
    (man / "man7" / "link.7").write_text(".so man7/plain.7\n")
    os.symlink(man / "man7" / "plain.7", man / "man7" / "symlink.7")
    gzipped(man / "de" / "man1" / "frob.1.gz", MAN_PAGE.replace("reads", "liest"))
    doc = root / "doc"
    (doc / "frob").mkdir(parents=True)
    (doc / "frob" / "README.md").write_text(f"# Frob\n\n{OTHER}\n\n{COPIED}\n")
    (doc / "frob" / "copyright").write_text(f"{SENTENCE} Licensed to you.\n")
    gzipped(doc / "frob" / "changelog.Debian.gz", f"{SENTENCE} Changed.\n")
    (doc / "python3-scipy").mkdir()
    (doc / "python3-scipy" / "README").write_text(f"{SENTENCE} Held out.\n")
    site = root / "site-packages"
    (site / "frobpkg").mkdir(parents=True)
    (site / "frobpkg" / "__init__.py").write_text(f'"""{OTHER}"""\n')
    (site / "frobpkg" / "copy.py").write_text(
        f'"""Frob copies.\n\n{COPIED}\n\n{SENTENCE}"""\n')
    (site / "frobpkg" / "GUIDE.md").write_text(f"{SENTENCE}\n")
    (site / "scipy").mkdir()
    (site / "scipy" / "__init__.py").write_text(f'"""A held-out module.\n\n{COPIED}"""\n')
    (site / "scipy" / "NOTES.md").write_text("Held-out notes that are long enough to be prose.\n")
    return SourceRoots(man=[str(man)], doc=[str(doc)], site_packages=[str(site)],
                       held_out=[str(site / "scipy")])


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path)


class TestSources:
    def test_manual_pages_english_only_once_each_without_links(self, tree):
        documents = read_source("man", tree)
        text = "\n\n".join(documents)
        assert text.count(SENTENCE) == 1           # the alpha variant and the symlink add nothing
        assert OTHER in text
        assert "liest" not in text                 # man/de is not English
        # frob's three prose paragraphs, the sentence (from either variant) and OTHER.
        assert sum(len(d.split("\n\n")) for d in documents) == 5

    def test_documentation_without_licenses_changelogs_or_held_out_folders(self, tree):
        documents = read_source("doc", tree)
        assert documents == [OTHER]                # COPIED is a held-out docstring paragraph

    def test_docstrings_of_other_packages_without_the_held_out_ones(self, tree):
        documents = read_source("more-docstrings", tree)
        assert sorted(documents) == sorted([OTHER, f"Frob copies.\n\n{SENTENCE}"])
        assert not any("held-out" in d for d in documents)

    def test_package_documentation_without_the_held_out_packages(self, tree):
        assert read_source("package-docs", tree) == [SENTENCE]
        assert not any("scipy" in path for path in source_files("package-docs", tree))

    def test_a_machine_without_manual_pages_gives_an_empty_source(self, tmp_path):
        roots = SourceRoots(man=[str(tmp_path / "none")], doc=[], site_packages=[],
                            held_out=[])
        assert read_source("man", roots) == []
        with pytest.raises(CorpusError, match="hold no text"):
            public_corpus_documents(["man"], 1000, roots=roots)


class TestHeldOutPackages:
    def test_the_names_the_fine_tuning_task_needs(self):
        assert HELD_OUT_PACKAGES == ("scipy", "sklearn", "matplotlib")
        assert HELD_OUT_DISTRIBUTIONS == ("scipy", "scikit-learn", "matplotlib")

    def test_no_file_of_a_held_out_package_is_a_source_file_here(self):
        import importlib.util

        files, folders = public_text.held_out_files()
        for package in HELD_OUT_PACKAGES:
            spec = importlib.util.find_spec(package)
            if spec is not None:
                assert any(os.path.samefile(folder, list(spec.submodule_search_locations)[0])
                           for folder in folders), package
        for source in ("more-docstrings", "package-docs"):
            for path in source_files(source):
                assert path not in files, path
                assert not any(path.startswith(folder + os.sep) for folder in folders), path


class TestCorpus:
    def test_equal_shares_and_the_rest_of_a_small_source_to_the_others(self, tree):
        sizes = {}
        documents = public_corpus_documents(["man", "doc", "more-docstrings"], 10_000,
                                            roots=tree, sizes=sizes)
        assert sizes["doc"]["characters"] == len(OTHER)
        assert sum(s["characters"] for s in sizes.values()) == sum(len(d) for d in documents)
        assert sizes["man"]["characters"] == sum(len(d) for d in read_source("man", tree))
        small = public_corpus_documents(["man"], 10, roots=tree)
        assert len(small) == 1                     # stops once the cap is reached

    @pytest.mark.parametrize("sources, message", [
        ("", "at least one"), ("man,frob", "unknown public source.*frob.*docstrings"),
        ("man,man", "twice")])
    def test_bad_source_names_are_refused_naming_the_choices(self, sources, message):
        with pytest.raises(CorpusError, match=message):
            parse_public_sources(sources)

    def test_every_source_has_a_description(self):
        assert set(PUBLIC_SOURCES) == {"docstrings", "more-docstrings", "man", "doc",
                                       "package-docs"}

    def test_the_text_is_cached_and_read_again_when_a_file_changes(self, tree, tmp_path,
                                                                   monkeypatch):
        cache = str(tmp_path / "cache")
        first = public_corpus_documents(["man", "doc"], 10_000, roots=tree, cache_dir=cache)
        reads = []
        original = public_text._read_text
        monkeypatch.setattr(public_text, "_read_text",
                            lambda path: reads.append(path) or original(path))
        assert public_corpus_documents(["man", "doc"], 10_000, roots=tree,
                                       cache_dir=cache) == first
        assert reads == []
        page = os.path.join(tree.man[0], "man7", "plain.7")
        with open(page, "a") as handle:
            handle.write(".PP\nA new paragraph makes the page longer than it was before.\n")
        changed = public_corpus_documents(["man", "doc"], 10_000, roots=tree, cache_dir=cache)
        assert reads and changed != first


def test_the_job_prepares_a_public_corpus_once_and_again_when_a_source_changes(
        tree, tmp_path, monkeypatch):
    from tf_megadp.jobs.bert import text

    monkeypatch.setattr(public_text, "SourceRoots", lambda: tree)
    public_text._machine_fingerprint.cache_clear()
    monkeypatch.setattr(public_text, "_machine_fingerprint",
                        lambda source: public_text.source_fingerprint(source, tree))
    settings = dict(public_sources=["man", "doc", "more-docstrings"], sequence_length=16,
                    vocabulary_size=120, min_tokens=2, max_characters=10_000,
                    text_cache_dir=str(tmp_path / "cache"))
    shards = text.prepare_corpus(tmp_path / "shards", None, **settings)
    manifest = shards.manifest
    assert manifest["source"] == "public corpus: man, doc, more-docstrings"
    expected = {}
    public_corpus_documents(["man", "doc", "more-docstrings"], 10_000, roots=tree,
                            sizes=expected)
    assert manifest["public_sources"] == expected
    assert text.prepare_corpus(tmp_path / "shards", None, **settings).manifest["checksum"] \
        == manifest["checksum"]
    with open(os.path.join(tree.doc[0], "frob", "README.md"), "a") as handle:
        handle.write("\nOne more paragraph of documentation changes the public corpus.\n")
    assert text.prepare_corpus(tmp_path / "shards", None, **settings).manifest["checksum"] \
        != manifest["checksum"]
