"""docs/plugins.md documents every hook of core/hookspecs.py, with its real signature and firstresult flag."""

from __future__ import annotations

import inspect
import re

import pytest
from repo_paths import ROOT

from pagedkv.core import hookspecs

DOC = ROOT / "docs" / "plugins.md"
SIGNATURE_LINE = re.compile(r"^\s*(pagedkv_\w+)\(.*\) -> .+$")
SECTION = re.compile(r"^### `(pagedkv_\w+)`\s*$", re.MULTILINE)


def hookspec_functions() -> dict[str, object]:
    marker = f"{hookspecs.PROJECT}_spec"
    return {name: fn for name, fn in vars(hookspecs).items() if inspect.isfunction(fn) and hasattr(fn, marker)}


def expected_signature(fn) -> str:
    """``name(a, b) -> ret`` from the spec itself (annotations are strings: the module defers them)."""
    sig = inspect.signature(fn)
    ret = sig.return_annotation
    ret = ret if isinstance(ret, str) else inspect.formatannotation(ret)
    return f"{fn.__name__}({', '.join(sig.parameters)}) -> {ret}"


def sections() -> dict[str, str]:
    text = DOC.read_text()
    parts = SECTION.split(text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_spec_module_has_hooks():
    assert len(hookspec_functions()) >= 14


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_every_hook_has_a_section_with_its_signature_and_firstresult_flag(name):
    fn = hookspec_functions()[name]
    docs = sections()
    assert name in docs, f"docs/plugins.md has no '### `{name}`' section"
    body = docs[name]
    signatures = [line.strip() for line in body.splitlines() if SIGNATURE_LINE.match(line)]
    assert signatures, f"the {name} section has no signature line"
    assert signatures[0] == expected_signature(fn), "the documented signature differs from core/hookspecs.py"
    firstresult = getattr(fn, f"{hookspecs.PROJECT}_spec").get("firstresult", False)
    flag = re.search(r"\*\*firstresult:\*\* (yes|no)\b", body)
    assert flag, f"the {name} section does not say whether it is firstresult"
    assert flag.group(1) == ("yes" if firstresult else "no"), f"{name}: firstresult is {firstresult}"
    assert "```python" in body, f"the {name} section has no example"


def test_no_stale_hooks_or_signatures_anywhere_in_the_docs():
    specs = {name: expected_signature(fn) for name, fn in hookspec_functions().items()}
    assert set(sections()) <= set(specs), "docs/plugins.md documents hooks that core/hookspecs.py no longer has"
    for line in DOC.read_text().splitlines():
        match = SIGNATURE_LINE.match(line)
        if match:
            assert match.group(1) in specs, f"unknown hook in docs: {line.strip()}"
            assert line.strip() == specs[match.group(1)], f"stale signature in docs: {line.strip()}"


def test_the_testing_helpers_are_documented():
    import pagedkv.testing

    text = DOC.read_text()
    for name in pagedkv.testing.__all__:
        if callable(getattr(pagedkv.testing, name)):
            assert f"`{name}(" in text, f"pagedkv.testing.{name} is not documented in docs/plugins.md"
