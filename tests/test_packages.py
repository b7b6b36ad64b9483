"""The packages a job brings: plain requirements only, each refusal naming its line (no database)."""

import pytest

from jobs import packages
from jobs.packages import PackagesError, merge, parse

pytestmark = pytest.mark.nodb


def test_requirements_are_read_one_a_line_without_comments_or_blank_lines():
    text = "# what the job needs\n\n  numpy>=1.26  \neinops==0.8.0 # pinned: 0.9 renamed a function\nrequests[socks]; python_version < '3.12'\n"
    assert parse(text) == ["numpy>=1.26", "einops==0.8.0", "requests[socks]; python_version < '3.12'"]


def test_empty_text_is_no_requirements():
    assert parse("") == [] and parse(None) == [] and parse("\n  \n# only a comment\n") == []


def test_torch_is_taken_as_given():
    # The builder on the node checks torch against its own; the form does not second-guess it.
    assert parse("torch==2.13.0\ntorchvision") == ["torch==2.13.0", "torchvision"]


@pytest.mark.parametrize(
    "line,words",
    [
        ("-e ./mypkg", "options such as -e, -r and --index-url are not taken"),
        ("-r other.txt", "options such as"),
        ("--index-url https://example.com/simple", "options such as"),
        ("--extra-index-url https://example.com/simple", "options such as"),
        ("-f ./wheels", "options such as"),
        ("--hash=sha256:abc", "options such as"),
        ("https://example.com/pkg-1.0-py3-none-any.whl", "a URL is not taken"),
        ("git+https://github.com/org/pkg.git", "a URL is not taken"),
        ("file:///home/me/pkg", "a URL is not taken"),
        ("pkg @ https://example.com/pkg-1.0.tar.gz", "a direct reference (name @ URL) is not taken"),
        ("pkg @ file:///home/me/pkg", "a direct reference"),
        ("./mypkg", "a local path is not taken"),
        ("../mypkg", "a local path is not taken"),
        ("/home/me/mypkg", "a local path is not taken"),
        ("~/mypkg", "a local path is not taken"),
        (".", "a local path is not taken"),
        ("libs/mypkg", "a local path is not taken"),
        ("mypkg-1.0-py3-none-any.whl", "a package file is not taken"),
        ("mypkg-1.0.tar.gz", "a package file is not taken"),
        ("numpy \\", "a line continuation"),
        ("numpy==", "not a requirement"),
        ("numpy >= one", "not a requirement"),
    ],
)
def test_anything_but_a_plain_requirement_is_refused_naming_its_line(line, words):
    with pytest.raises(PackagesError) as raised:
        parse(f"numpy>=1.26\n# a comment\n{line}\n")
    assert str(raised.value).startswith(f"line 3 ({line}): ") and words in str(raised.value)
    assert raised.value.line == 3


def test_a_refusal_says_where_packages_come_from():
    with pytest.raises(PackagesError, match=r"come from the package index, by name \(numpy>=1.26\)"):
        parse("--index-url https://mirror.example/simple")


def test_a_line_longer_than_the_limit_is_refused():
    assert parse("a" * packages.MAX_LINE) == ["a" * packages.MAX_LINE]
    with pytest.raises(PackagesError, match=f"line 2 .* is longer than {packages.MAX_LINE} characters"):
        parse("numpy\n" + "a" * (packages.MAX_LINE + 1))


def test_a_long_comment_is_no_long_requirement():
    assert parse("numpy  # " + "why " * 100) == ["numpy"]


def test_at_most_the_limit_of_requirements():
    names = [f"pkg{i}" for i in range(packages.MAX_REQUIREMENTS)]
    assert parse("\n".join(names)) == names
    with pytest.raises(PackagesError, match=f"at most {packages.MAX_REQUIREMENTS}"):
        parse("\n".join([*names, "one-more"]))


def test_merge_keeps_the_form_s_order_then_the_archive_s_each_requirement_once():
    form = "numpy>=1.26\neinops==0.8.0"
    requirements_txt = "# from the archive\nnumpy >= 1.26\nscipy\neinops==0.8.0\n"
    assert merge(form, requirements_txt) == "numpy>=1.26\neinops==0.8.0\nscipy"


def test_merge_of_nothing_is_empty_text():
    assert merge("", None, "# nothing\n") == ""


def test_merge_refuses_a_bad_line_of_any_text():
    with pytest.raises(PackagesError, match=r"line 2 \(-e \.\)"):
        merge("numpy", "scipy\n-e .")


def test_merge_holds_the_limit_over_all_texts_together():
    half = packages.MAX_REQUIREMENTS // 2 + 1
    first = "\n".join(f"a{i}" for i in range(half))
    second = "\n".join(f"b{i}" for i in range(half))
    with pytest.raises(PackagesError, match=f"{2 * half} requirements in all: a job may name at most {packages.MAX_REQUIREMENTS}"):
        merge(first, second)
