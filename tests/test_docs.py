"""The documentation site builds with ``mkdocs build --strict`` (warnings are errors: broken
links, missing pages, bad docstring references), and what it states about the code and
about Mooncake stays true.

The docs extra (``pip install -e '.[docs]'``) is installed by scripts/setup.sh, so this test
fails rather than skips where mkdocs is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the docs extra is not installed ({e}): pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_site_builds_strictly_with_every_page(site):
    for page in ("index.html", "concepts/leases/index.html", "concepts/consistency/index.html",
                 "operations/ports/index.html", "operations/security/index.html",
                 "operations/mooncake/index.html", "reference/api/index.html",
                 "reference/testing/index.html", "guides/examples/index.html"):
        assert (site / page).is_file(), page
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert "{{ " not in text, f"{html}: a hook placeholder was not replaced"
        assert "--8<--" not in text, f"{html}: a snippet was not included"


def test_api_reference_covers_the_public_api(site):
    import tensorhub
    import tensorhub.testing

    api = (site / "reference/api/index.html").read_text()
    for name in tensorhub.__all__:
        if name != "__version__":
            assert f'id="tensorhub.{name}"' in api, f"tensorhub.{name} is missing from the API reference"
    testing = (site / "reference/testing/index.html").read_text()
    for name in tensorhub.testing.__all__:
        assert f'id="tensorhub.testing.{name}"' in testing, f"tensorhub.testing.{name} is missing"


def test_configuration_lists_every_environment_variable(site):
    from tensorhub import envs

    page = (site / "operations/configuration/index.html").read_text()
    for name in envs.ENVIRONMENT_VARIABLES:
        assert name in page, name


def test_mooncake_ports_come_from_the_documented_range():
    """docs/operations/ports.md: both listening ports of a Mooncake engine lie in
    MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (what a firewall rule relies on)."""
    pytest.importorskip("mooncake.engine")
    script = textwrap.dedent("""
        import os, subprocess
        from tensorhub.transport import MooncakeTransport
        t = MooncakeTransport(host="127.0.0.1")
        endpoint = t.start()
        out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
        ports = sorted({int(l.split()[3].rsplit(":", 1)[1]) for l in out.splitlines()
                        if f"pid={os.getpid()}," in l})
        print(endpoint.rsplit(":", 1)[1], *ports)
        t.close()
    """)
    lo, hi = 23400, 23439
    env = dict(os.environ, MC_MIN_RPC_PORT=str(lo), MC_MAX_RPC_PORT=str(hi), GLOG_minloglevel="2")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    handshake, *listening = (int(x) for x in r.stdout.split())
    assert len(listening) == 2, f"expected the handshake and the TCP data port, got {listening}"
    assert handshake in listening
    assert all(lo <= p <= hi for p in listening), f"{listening} not in [{lo}, {hi}]"


def test_readme_starts_with_the_two_commands():
    head = (ROOT / "README.md").read_text().splitlines()[:6]
    assert any(line.startswith("bash scripts/demo.sh") for line in head), head
    assert any(line.startswith("bash scripts/test.sh") for line in head), head
