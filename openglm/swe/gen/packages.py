"""The pinned PyPI packages the benchmark generator mines (data only: name, version, layout).

All are pure Python with test suites shipped in their sdists and no test dependencies beyond pytest
(semver also imports `packaging`, which the environment has). `source` lists what may be mutated;
`tests` what pytest runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackageSpec:
    name: str
    version: str
    source: tuple[str, ...]
    tests: tuple[str, ...]

    @property
    def slug(self) -> str:
        return f"{self.name}-{self.version}"


PACKAGES = [
    PackageSpec("more-itertools", "10.5.0", ("more_itertools",), ("tests",)),
    PackageSpec("toolz", "1.0.0", ("toolz",), ("toolz/tests",)),
    PackageSpec("inflection", "0.5.1", ("inflection",), ("test_inflection.py",)),
    PackageSpec("cachetools", "5.5.0", ("src/cachetools",), ("tests",)),
    PackageSpec("semver", "3.0.2", ("src/semver",), ("tests",)),
    PackageSpec("parse", "1.20.2", ("parse.py",), ("tests",)),
    PackageSpec("webcolors", "24.8.0", ("src/webcolors",), ("tests",)),
    PackageSpec("jmespath", "1.0.1", ("jmespath",), ("tests",)),
]


def by_name(names: list[str] | None) -> list[PackageSpec]:
    if not names:
        return list(PACKAGES)
    known = {p.name: p for p in PACKAGES}
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"unknown package(s) {missing}; pinned: {sorted(known)}")
    return [known[n] for n in names]
