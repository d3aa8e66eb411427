"""mkdocs hooks of the API reference site (``make docs``; docs/site.md).

* The home page is README.md, its ``docs/`` links made relative to the site; the examples
  page is examples/README.md.
* The reference pages are generated from the public modules' ``__all__``: one page per
  top-level name of :mod:`deepsolve` (``reference/unroll.md`` ...) and one page per public
  subpackage listing each of its names. Nothing generated is committed, so a new public name
  gets its page on the next build, and a docstring reference to a missing one fails the strict
  build.
* Docstrings use Sphinx roles (``:func:`deepsolve.plan```); :class:`RstRoles`, a griffe
  extension, turns each into a cross-reference when the target has a reference entry, and into
  plain code otherwise (private helpers are named, not documented).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import griffe
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]

#: the subpackages and modules with a reference page, in navigation order
MODULES = ["deepsolve.schedules", "deepsolve.memory", "deepsolve.reversible",
           "deepsolve.stability", "deepsolve.fixed_point",
           "deepsolve.sequential", "deepsolve.pinn", "deepsolve.io", "deepsolve.io.tracking",
           "deepsolve.distributed", "deepsolve.physics", "deepsolve.gradcheck",
           "deepsolve.problem", "deepsolve.training", "deepsolve.training.check"]


def _public(module: str) -> list[str]:
    """The public names of ``module`` less the submodules it exports (``deepsolve.schedules``,
    ``deepsolve.reversible``, ``deepsolve.stability``: pages of their own in
    :data:`MODULES`)."""
    mod = importlib.import_module(module)
    return [n for n in mod.__all__ if not n.startswith("_")
            and not inspect.ismodule(getattr(mod, n, None))]


def _top_identifier(name: str) -> str:
    """The reference identifier of ``deepsolve.<name>``: ``deepsolve.unroll`` is both a
    function and a submodule, and griffe reads the dotted path as the module, so the three
    such names (unroll, fixed_point, sequential) are documented at ``deepsolve.unroll.unroll``."""
    try:
        importlib.import_module(f"deepsolve.{name}")
    except ImportError:
        return f"deepsolve.{name}"
    return f"deepsolve.{name}.{name}"


def _module_names(mod: str) -> list[str]:
    """The names a module page documents: its ``__all__`` less the ones with a page of
    their own (``deepsolve.fixed_point.fixed_point``)."""
    return [n for n in _public(mod) if f"{mod}.{n}" != _top_identifier(n)]


def entries() -> dict[str, list[str]]:
    """src_uri of each reference page -> the identifiers it documents, in order (a module
    page starts with the module itself, rendered without members)."""
    out = {f"reference/{n}.md": [_top_identifier(n)] for n in _public("deepsolve")}
    for mod in MODULES:
        out[f"reference/{mod}.md"] = [mod] + [f"{mod}.{n}" for n in _module_names(mod)]
    return out


def _pages() -> dict[str, str]:
    """src_uri -> Markdown of every reference page."""
    pages = {}
    for uri, idents in entries().items():
        title = uri[len("reference/"):-len(".md")]
        title = title if title.startswith("deepsolve.") else f"deepsolve.{title}"
        body = [f"# {title}\n"]
        for ident in idents:
            body.append(f"::: {ident}\n" + ("    options:\n      members: false\n"
                                            if ident in MODULES else ""))
        pages[uri] = "\n".join(body)
    top = _public("deepsolve")
    index = ["# API reference\n", "Generated from the docstrings of the public names "
             "(each module's `__all__`).\n", "## deepsolve\n"]
    index += [f"- [`deepsolve.{n}`]({n}.md)" for n in top]
    index += ["", "## Modules\n"] + [f"- [`{m}`]({m}.md)" for m in MODULES]
    pages["reference/index.md"] = "\n".join(index) + "\n"
    return pages


def documented() -> set[str]:
    """Every identifier the reference pages define (``deepsolve.pinn.FNN``, ...)."""
    return {ident for idents in entries().values() for ident in idents}


def on_config(config):
    pages = _pages()
    ref = [{"Overview": "reference/index.md"},
           {"deepsolve": [{n: f"reference/{n}.md"} for n in _public("deepsolve")]}]
    ref += [{m: f"reference/{m}.md"} for m in MODULES]
    if (ROOT / "examples" / "README.md").exists():
        config["nav"].append({"Examples": "examples.md"})
    config["nav"].append({"API reference": ref})
    config["_deepsolve_pages"] = pages
    return config


def on_files(files, config):
    readme = (ROOT / "README.md").read_text()
    readme = re.sub(r"\]\(docs/", "](", readme).replace("](examples/README.md)",
                                                          "](examples.md)")
    files.append(File.generated(config, "index.md", content=readme))
    examples = ROOT / "examples" / "README.md"
    if examples.exists():   # its links to the scripts become their names (not in the site)
        text = re.sub(r"\[([^\]]+)\]\((?!https?:)[^)]+\.py\)", r"\1", examples.read_text())
        files.append(File.generated(config, "examples.md", content=text))
    for uri, text in config["_deepsolve_pages"].items():
        files.append(File.generated(config, uri, content=text))
    return files


_ROLE = re.compile(r":(?:py:)?(func|class|mod|meth|attr|data|exc|obj):`(~?)([\w.]+)(?:\(\))?`")


#: an Args entry documenting several parameters at once: ``    lr, max_iter: ...``
_GROUPED = re.compile(r"^(?P<indent>[ \t]+)(?P<names>\w+(?:, \w+)+): (?P<text>.*)$", re.M)


def _split_grouped(m: re.Match) -> str:
    """One entry per parameter (Google style has no grouped entries); each keeps the text."""
    names = m.group("names").split(", ")
    return "\n".join(f"{m.group('indent')}{n}: {m.group('text')}" for n in names)


class RstRoles(griffe.Extension):
    """Sphinx roles in docstrings -> autorefs links (documented targets) or code spans."""

    def __init__(self) -> None:
        super().__init__()
        self.known = documented()

    def _target(self, name: str, obj: griffe.Object) -> str | None:
        if name.startswith("."):
            name = obj.package.path + name if name.count(".") == 1 else name.lstrip(".")
        for cand in (name, f"{obj.module.path}.{name}", f"deepsolve.{name}"):
            if cand in self.known:
                return cand
            if f"{cand}.{cand.rsplit('.', 1)[-1]}" in self.known:   # deepsolve.unroll
                return f"{cand}.{cand.rsplit('.', 1)[-1]}"
        return None

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is None:
            return
        text = obj.docstring.value

        def sub(m: re.Match) -> str:
            tilde, name = m.group(2), m.group(3)
            shown = name.rsplit(".", 1)[-1] if tilde else name.lstrip(".")
            target = self._target(name, obj)
            return f"[`{shown}`][{target}]" if target else f"`{shown}`"

        new = _GROUPED.sub(_split_grouped, _ROLE.sub(sub, text))
        if new != text:
            obj.docstring.value = new
