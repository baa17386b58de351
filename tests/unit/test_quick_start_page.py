"""The getting-started page's quick start holds everything a newcomer needs, and the
README shows the same commands (the end-to-end test runs them: tests/e2e/test_quick_start.py)."""

from testkit import quick_start
from testkit.support import REPO


def test_the_page_has_the_image_step_and_both_installs():
    found = quick_start.blocks()
    assert set(found) == {"image", "cluster-admin", "namespace"}
    builds, loaded = quick_start.image_step(found["image"])
    targets = {b.target: b.name for b in builds}
    assert set(targets) == {"sidecar", "operator"}
    assert sorted(loaded) == sorted(targets.values()), "every image built is loaded"
    admin = " ".join(quick_start.commands(found["cluster-admin"]))
    spaced = " ".join(quick_start.commands(found["namespace"]))
    assert "--create-namespace" in admin
    assert "--create-namespace" not in spaced  # a namespace owner cannot create one
    assert "rbac.podPatchPolicy=false" in spaced and "injector.enabled=true" not in spaced
    for install in (admin, spaced):
        repository, tag = targets["sidecar"].split(":")
        assert f"image.repository={repository}" in install
        assert f"image.tag={tag}" in install
        assert install.endswith(f"kubectl -n {quick_start.NAMESPACE} get pods -L lease-role")
    assert f"image.operatorRepository={targets['operator'].split(':')[0]}" in admin


def test_the_page_states_the_versions_and_a_virtualenv():
    text = quick_start.PAGE.read_text()
    assert "Kubernetes 1.29 or newer" in text and "Python 3.11 or newer" in text
    assert "python3 -m venv .venv && . .venv/bin/activate" in text
    assert 'kubeVersion: ">=1.29.0-0"' in (REPO / "charts/lease-sidecar/Chart.yaml").read_text()
    assert 'requires-python = ">=3.11"' in (REPO / "pyproject.toml").read_text()


def test_the_readme_shows_the_same_commands():
    readme = (REPO / "README.md").read_text()
    found = quick_start.blocks()
    for name in ("image", "cluster-admin"):
        assert f"```sh\n{found[name]}```" in readme, name
    assert "python3 -m venv .venv && . .venv/bin/activate" in readme
