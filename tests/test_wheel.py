"""The built wheel carries the templates: install it apart from the checkout and render them."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# pip's messages when it cannot reach an index to fetch the build requirements
NO_NETWORK = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Name or service not known|Network is unreachable|ProxyError|"
    r"ConnectTimeoutError|Max retries exceeded|No matching distribution found for "
    r"(setuptools|wheel)|Could not find a version that satisfies the requirement "
    r"(setuptools|wheel)", re.I)

# what a build copies from: the working tree less VCS data and build outputs
IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                ".pytest_cache", ".hypothesis", "*.whl")

RENDER_ALL = textwrap.dedent('''
    import sys
    import cuda_backend
    from cuda_backend import KernelGenerator
    from cuda_backend.compiler import declared_kernels
    from cuda_backend.kernels import template_variants, templates_path
    print("FILE", cuda_backend.__file__)
    print("TEMPLATES_PATH", templates_path())
    gen = KernelGenerator(backend=object())
    names = gen.list_templates()
    variants = template_variants()
    assert set(names) == set(variants), (names, sorted(variants))
    count = 0
    for template in names:
        for params in variants[template]:
            name, source = gen.render_kernel(template, **dict(params))
            assert declared_kernels(source) == [name], (template, params)
            count += 1
    print("TEMPLATES", ",".join(names))
    print("RENDERED", count)
''')


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def test_wheel_installs_and_renders_every_template(tmp_path):
    # Build from a copy so a stale build/ or egg-info in the checkout cannot leak into the
    # wheel and the build leaves nothing behind in the checkout. symlinks=True keeps
    # cuda_backend/templates a link, as it is in a clone.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=IGNORE)
    assert (src / "cuda_backend" / "templates").is_symlink()
    wheels = tmp_path / "wheels"
    build = run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-w", str(wheels)])
    if build.returncode != 0:
        out = build.stdout + build.stderr
        if NO_NETWORK.search(out):
            pytest.skip("pip cannot fetch the build requirements (no network)")
        pytest.fail(f"pip wheel failed:\n{out}")
    built = list(wheels.glob("cuda_backend-*.whl"))
    assert len(built) == 1, list(wheels.iterdir())

    # the wheel lists the templates as real files
    import zipfile
    with zipfile.ZipFile(built[0]) as zf:
        members = set(zf.namelist())
    repo_templates = sorted(p.name for p in (REPO / "templates").glob("*.j2"))
    assert repo_templates
    for name in repo_templates:
        assert f"cuda_backend/templates/{name}" in members, sorted(members)
    assert not any(m.startswith("tests/") for m in members)

    site = tmp_path / "site"
    install = run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                   "--target", str(site), str(built[0])])
    assert install.returncode == 0, install.stdout + install.stderr
    assert not (site / "cuda_backend" / "templates").is_symlink()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = run([sys.executable, "-c", RENDER_ALL], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    module_file = Path(info["FILE"]).resolve()
    assert module_file.is_relative_to(site.resolve()), module_file
    assert not module_file.is_relative_to(REPO), module_file
    assert Path(info["TEMPLATES_PATH"]).resolve().is_relative_to(site.resolve())
    public = sorted(n for n in repo_templates if not n.startswith("_"))
    assert info["TEMPLATES"].split(",") == public
    from cuda_backend.kernels import template_variants
    assert int(info["RENDERED"]) == sum(len(v) for v in template_variants().values())
