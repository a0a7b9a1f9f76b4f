"""mkdocs hooks: tables generated from the code, so the site cannot drift from it.

* ``{{ env_table }}`` -- every variable in ``tensorhub.envs.ENVIRONMENT_VARIABLES``, with its
  default (read with an empty environment) and its documentation.
* ``{{ cli_help NAME }}`` -- ``tensorhub NAME --help`` as the installed parser prints it.
* ``{{ http_routes }}`` -- the coordinator's HTTP routes, from the application itself.
* ``{{ metrics coordinator|hub }}`` -- the Prometheus metrics the coordinator / a Hub
  process exports: name, type and help text, from the registries themselves.
* ``{{ api MODULE errors|other|all }}`` -- a mkdocstrings block for each name of
  ``MODULE.__all__`` (its exceptions, the rest, or all), so the reference follows the API.
"""

from __future__ import annotations

import io
import os
import re
from contextlib import redirect_stdout
from unittest import mock


def _env_table() -> str:
    from tensorhub import envs

    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    with mock.patch.dict(os.environ, {}, clear=True):
        for name, (get, doc) in envs.ENVIRONMENT_VARIABLES.items():
            default = get()
            shown = "-" if default in (None, "") else f"`{default}`"
            rows.append(f"| `{name}` | {shown} | {doc.replace('|', '/')} |")
    return "\n".join(rows)


def _cli_help(name: str) -> str:
    from tensorhub.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    buf = io.StringIO()
    with redirect_stdout(buf), mock.patch.dict(os.environ, {"COLUMNS": "100"}):
        sub.choices[name].print_help()
    return "```text\n" + buf.getvalue().rstrip() + "\n```"


def _http_routes() -> str:
    import tempfile

    from tensorhub.coordinator import Coordinator, create_app

    with tempfile.TemporaryDirectory() as d:
        coord = Coordinator(d)
        try:
            app = create_app(coord)
        finally:
            coord.close()
    rows = ["| method | path |", "| --- | --- |"]
    for r in app.routes:
        methods = sorted(getattr(r, "methods", None) or [])
        if not methods or r.path in ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"):
            continue
        rows.append(f"| {', '.join(m for m in methods if m != 'HEAD')} | `{r.path}` |")
    return "\n".join(rows)


def _api(module: str, which: str) -> str:
    import importlib

    names = [n for n in importlib.import_module(module).__all__ if not n.startswith("__")]
    if which == "errors":
        names = [n for n in names if n.endswith("Error")]
    elif which == "other":
        names = [n for n in names if not n.endswith("Error")]
    return "\n\n".join(f"::: {module}.{n}" for n in names)


def _metrics(which: str) -> str:
    import tempfile

    if which == "coordinator":
        from tensorhub.coordinator import Coordinator

        with tempfile.TemporaryDirectory() as d:
            coord = Coordinator(d)
            try:
                families = list(coord.metrics.registry.collect())
            finally:
                coord.close()
    else:
        from prometheus_client import CollectorRegistry

        from tensorhub._metrics import HubMetrics

        registry = CollectorRegistry()
        HubMetrics(registry=registry)
        families = list(registry.collect())
    rows = ["| metric | type | what |", "| --- | --- | --- |"]
    for f in sorted(families, key=lambda f: f.name):
        name = f.name + ("_total" if f.type == "counter" else "")
        rows.append(f"| `{name}` | {f.type} | {' '.join(f.documentation.split()).replace('|', '/')} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    markdown = re.sub(r"\{\{ metrics (coordinator|hub) \}\}", lambda m: _metrics(m.group(1)), markdown)
    markdown = re.sub(r"\{\{ api ([a-z_.]+) (errors|other|all) \}\}", lambda m: _api(m.group(1), m.group(2)),
                      markdown)
    if "{{ env_table }}" in markdown:
        markdown = markdown.replace("{{ env_table }}", _env_table())
    if "{{ http_routes }}" in markdown:
        markdown = markdown.replace("{{ http_routes }}", _http_routes())
    return re.sub(r"\{\{ cli_help ([a-z-]+) \}\}", lambda m: _cli_help(m.group(1)), markdown)


_ROLE = re.compile(r":(?:class|meth|func|mod|attr|exc|data|obj):(?=<code>)")


def on_page_content(html: str, **kwargs: object) -> str:
    """Docstrings use Sphinx roles (:class:`X`); Markdown renders the `X` part as code and
    leaves the role's name in front of it: drop the name."""
    return _ROLE.sub("", html)
