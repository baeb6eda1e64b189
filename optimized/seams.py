"""Which convention seams a fast path may assume: a kernel that computes a rule itself (instead of calling the seam
in optimized.masks or optimized.scoring) may run only while that seam is still the function it implements, so a
replaced seam (what the conformance self-test does to plant a bug) changes every path alike."""

from __future__ import annotations

from types import ModuleType


class SeamSnapshot:
    """The functions `names` of `module` as imported; unchanged() is True while each is still that function
    (identity, not equality: a wrapper or a copy counts as replaced)."""

    def __init__(self, module: ModuleType, *names: str) -> None:
        self.module = module
        self.rules = {name: getattr(module, name) for name in names}

    def unchanged(self) -> bool:
        return all(getattr(self.module, name) is rule for name, rule in self.rules.items())
