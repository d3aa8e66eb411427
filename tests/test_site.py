"""The API reference site: ``mkdocs build --strict`` passes (a broken link, anchor or
docstring reference fails it), every public name has its entry, and the built pages render in
a real browser (headless Chromium, Debian's ``chromium`` package) with the ``unroll``
signature on its reference page."""

from __future__ import annotations

import functools
import http.server
import importlib
import inspect
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import deepsolve

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytest.importorskip("mkdocstrings_handlers.python", reason="install the [docs] extra")
sys.path.insert(0, str(ROOT / "docs" / "site"))
hooks = importlib.import_module("hooks")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "--site-dir", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


@pytest.mark.slow
def test_every_public_name_has_a_rendered_entry(site: Path):
    pages = hooks._pages()
    for uri in pages:
        assert (site / uri.replace(".md", "/index.html").replace("index/index.html",
                                                                  "index.html")).exists(), uri
    missing = [ident for uri, idents in hooks.entries().items()
               for html in [(site / uri.replace(".md", "/index.html")).read_text()]
               for ident in idents if f'id="{ident}"' not in html]
    assert not missing, f"no rendered entry for {missing[:10]}"
    # a new public name gets its entry with no edit of the site: the pages follow __all__
    import deepsolve
    assert {f"reference/{n}.md" for n in deepsolve.__all__ if n not in ("schedules", "reversible",
            "stability", "__version__")} <= set(pages)
    assert "reference/deepsolve.stability.md" in pages


@pytest.mark.slow
def test_docstring_roles_become_links(site: Path):
    html = (site / "reference" / "unroll" / "index.html").read_text()
    assert ":class:" not in html and ":func:" not in html
    assert 'href="../Revolve/#deepsolve.Revolve"' in html      # :class:`~deepsolve.Revolve`


def _serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None   # type: ignore[attr-defined]
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def _render(url: str, profile: Path) -> str:
    """The DOM after Chromium has loaded ``url`` and run its scripts."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=3000",
           "--dump-dom", url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), f"chromium failed on {url}:\n{r.stderr[-2000:]}"
    return r.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: install Debian's chromium package "
                    "(.ci/run does it when it can) to check the site in a real browser")
def test_site_renders_in_a_real_browser(site: Path, tmp_path):
    srv, base = _serve(site)
    try:
        index = _render(f"{base}/index.html", tmp_path / "p1")
        assert "<title>deepsolve</title>" in index
        assert "Gradients through 5000 solver steps" in index           # the README
        assert 'href="reference/"' in index or "API reference" in index  # the navigation
        page = _render(f"{base}/reference/unroll/", tmp_path / "p2")
        import re
        text = re.sub(r"<[^>]+>", "", page)
        sig = text[text.index("unroll("):][:2000]
        # the parameters as the code declares them today, so a renamed type is checked, not
        # remembered (the annotations are strings under ``from __future__ import annotations``)
        params = inspect.signature(deepsolve.unroll).parameters
        parts = [str(params[name]).replace("'", "") for name in ("step", "n_steps", "budget")]
        for part in parts:
            assert part in sig, f"rendered signature lacks {part!r}: {sig[:400]}"
        assert "Run x_{i+1} = step(x_i, i)" in text                     # the docstring
        # the browser ran the theme's scripts: material marks the page as loaded
        assert 'data-md-color-scheme' in page or "md-search" in page
    finally:
        srv.shutdown()
