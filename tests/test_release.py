"""What a release wheel says about itself: its arches (file name, WHEEL metadata, the CUDA_ARCHS metadata
file, build_info()), its timestamps (SOURCE_DATE_EPOCH), and the release configuration that builds it."""

import importlib.metadata
import re
import subprocess
import tomllib
import zipfile
from datetime import datetime, timezone

import pytest

import prime_kernels
from conftest import REPO

CORE = importlib.metadata.distribution("prime-kernels-core")


def _arch_tag(value: str) -> str:
    out = subprocess.run(["bash", "-c", 'source ci/cuda_archs.sh && arch_tag "$1"', "_", value], cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("value,tag", [("90a;100a", "90a_100a"), ("100a;90a", "90a_100a"), ("90a", "90a"),
                                       (" 90a-real ; 100a-real ", "90a_100a"), ("100f;103a", "103a_100f"),
                                       ("90a;90a", "90a"), ("100a;103a;100f;90a", "90a_100a_103a_100f")])
def test_the_build_tag_names_the_arches_in_the_accepted_order(value, tag):
    assert _arch_tag(value) == tag


def test_installed_wheel_metadata_names_its_arches():
    archs = prime_kernels.build_info()["cuda_archs"]
    assert archs
    assert CORE.read_text("CUDA_ARCHS").split() == list(archs)
    wheel = CORE.read_text("WHEEL")
    build = re.search(r"^Build: (\S+)$", wheel, re.M)
    # A wheel pip builds from the sdist for non-default arches carries no build tag (pyproject.toml).
    if build is None:
        pytest.skip("this wheel has no build tag (built without ci/build_wheel.sh or cibuildwheel)")
    assert build.group(1) == "_".join(archs) == _arch_tag(";".join(archs))


def test_wheel_file_in_wheelhouse_is_named_by_its_arches():
    wheels = sorted((REPO / "wheelhouse").glob("prime_kernels_core-*.whl"))
    if not wheels:
        pytest.skip("no wheelhouse/ here (the test runs from a copy of the sources)")
    for whl in wheels:
        name, version, build, *_ = whl.name.split("-")
        with zipfile.ZipFile(whl) as z:
            info = next(n for n in z.namelist() if n.endswith("/_build_info.py"))
            archs = re.search(r'cuda_archs = tuple\(a for a in "([^"]*)"', z.read(info).decode()).group(1)
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/CUDA_ARCHS"))
            assert z.read(meta).decode().split() == archs.split(",")
        assert build == archs.replace(",", "_"), whl.name


def _head() -> tuple[str, int] | None:
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    when = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=REPO, capture_output=True, text=True)
    if sha.returncode != 0 or when.returncode != 0:
        return None
    return sha.stdout.strip(), int(when.stdout)


def test_build_date_is_the_source_date_epoch_of_the_commit():
    """ci/build_wheel.sh (and a build from the sdist) takes SOURCE_DATE_EPOCH from the commit's time."""
    head = _head()
    if head is None or prime_kernels.build_info()["git_sha"] != head[0]:
        pytest.skip("the installed wheel was not built from this checkout's commit")
    want = datetime.fromtimestamp(head[1], tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert prime_kernels.build_info()["build_date"] == want


def test_wheelhouse_zip_entries_carry_the_commit_time():
    head = _head()
    wheels = sorted((REPO / "wheelhouse").glob("prime_kernels_core-*.whl")) if head else []
    checked = 0
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            info = next(n for n in z.namelist() if n.endswith("/_build_info.py"))
            if f'git_sha = "{head[0]}"' not in z.read(info).decode():
                continue
            stamps = {i.date_time for i in z.infolist()}
        # Zip entries store time in 2-second steps.
        epoch = datetime.fromtimestamp(head[1] // 2 * 2, tz=timezone.utc)
        assert stamps == {epoch.timetuple()[:6]}, (whl.name, stamps)
        checked += 1
    if not checked:
        pytest.skip("no wheel of this checkout's commit in wheelhouse/")


def test_release_config_tags_and_tests_what_it_builds():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())
    cibw = conf["tool"]["cibuildwheel"]
    archs = cibw["linux"]["environment"]["PRIME_KERNELS_CUDA_ARCHS"]
    assert cibw["config-settings"]["wheel.build-tag"] == _arch_tag(archs)
    default = conf["tool"]["scikit-build"]["cmake"]["define"]["PRIME_KERNELS_CUDA_ARCHS"]["default"]
    assert conf["tool"]["scikit-build"]["wheel"]["build-tag"] == _arch_tag(default)
    assert cibw["test-command"] == "bash ci/cibw_test.sh"
    assert {"tests", "ci", "dropin", "dropin-dist"} <= set(cibw["test-sources"])
    assert all((REPO / p).exists() for p in cibw["test-sources"] if p != "dropin-dist")
    release = (REPO / "ci" / "release_build.sh").read_text()
    assert "dropin-dist" in release and release.index("dropin-dist") < release.index("cibuildwheel --platform")


def test_release_workflow_uploads_only_on_a_version_tag():
    wf = (REPO / ".github" / "workflows" / "release.yml").read_text()
    jobs = wf[wf.index("\njobs:"):]
    publish = jobs[jobs.index("\n  publish:"):]
    assert "if: startsWith(github.ref, 'refs/tags/v')" in publish.splitlines()[2]
    assert "needs: [wheels, sdist]" in publish
    before = jobs[:jobs.index("\n  publish:")]
    assert "pypi-publish" not in before and "gh release" not in before
    assert "ci/release_build.sh" in before and "ci/build_sdist.sh" in before
    for script in ("release_build.sh", "build_sdist.sh", "release_publish.sh"):
        assert "twine check --strict" in (REPO / "ci" / script).read_text(), script


def test_the_wheel_claims_torch_2_10_and_runs_on_this_torch():
    """ci/test.sh runs this suite under torch 2.10.0 (the oldest claimed) and the newest pinned one."""
    import torch

    assert "torch>=2.10" in importlib.metadata.requires("prime-kernels-core")
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert (major, minor) >= (2, 10)
    assert prime_kernels._lib.load().shim_loaded, prime_kernels._lib.load().reason


@pytest.mark.parametrize("name", ["prime_kernels_core", "prime_kernels"])
def test_each_sdist_carries_the_licence_and_project_urls(name):
    import tarfile

    sdists = sorted((REPO / "dist-sdist").glob(f"{name}-*.tar.gz"))
    if not sdists:
        pytest.skip("no dist-sdist/ here (ci/build_sdist.sh makes it)")
    with tarfile.open(sdists[-1]) as t:
        root = t.getnames()[0].split("/")[0]
        pkg_info = t.extractfile(f"{root}/PKG-INFO").read().decode()
        licence = t.extractfile(f"{root}/LICENSE").read()
    assert licence == (REPO / "LICENSE").read_bytes()
    assert "License-Expression: MIT" in pkg_info
    urls = {line.split(": ", 1)[1].split(", ", 1)[0] for line in pkg_info.splitlines() if line.startswith("Project-URL:")}
    assert {"Homepage", "Source", "Issues"} <= urls, urls
