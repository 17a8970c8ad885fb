"""The dependency floors in pyproject.toml are true: what is installed meets
every declared range, and each floor is at least the first release that has
the newest API the project calls. Installs nothing."""

from __future__ import annotations

import pkgutil
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENTS = [Requirement(r) for r in PROJECT["dependencies"]]

# API the project calls -> (distribution, the first release that has it).
NEWEST_API = {
    "sse_starlette.sse.AppStatus.disable_automatic_graceful_drain": ("sse-starlette", "3.2"),
}


def floor(name: str) -> Version | None:
    requirement = next(r for r in REQUIREMENTS if r.name == name)
    lows = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    return max(lows, default=None)


@pytest.mark.parametrize("requirement", REQUIREMENTS, ids=str)
def test_installed_version_meets_the_declared_range(requirement):
    installed = metadata.version(requirement.name)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{requirement.name} {installed} is installed, pyproject.toml says {requirement}")


@pytest.mark.parametrize("api", sorted(NEWEST_API))
def test_floor_is_at_least_the_release_that_has_the_api(api):
    name, first = NEWEST_API[api]
    declared = floor(name)
    assert declared is not None and declared >= Version(first), (
        f"the project calls {api} (new in {name} {first}), but pyproject.toml allows {name}>={declared}")


@pytest.mark.parametrize("api", sorted(NEWEST_API))
def test_the_api_exists_in_the_installed_release(api):
    assert callable(pkgutil.resolve_name(api))


# The top-level packages pagedserve installs (pyproject.toml's packages.find).
OUR_PACKAGES = ("engine", "kernels", "service", "clients", "bench", "pagedserve")


@pytest.mark.parametrize("package", OUR_PACKAGES)
def test_no_other_installed_distribution_ships_our_package_names(package):
    """Another distribution with one of our import names would shadow ours or be
    shadowed (transformers >= 5.25 pulls in Hugging Face's `kernels` and then
    imports our kernels/ as if it were that)."""
    others = [name for name in metadata.packages_distributions().get(package, [])
              if name.lower() != "pagedserve"]
    assert not others, f"{others} also install a top-level `{package}` package: it collides with ours"

