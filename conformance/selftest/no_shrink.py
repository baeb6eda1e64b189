"""pytest plugin for the self-test's subprocesses (`-p conformance.selftest.no_shrink`): keep the active
hypothesis profile but skip the shrink phase. A broken variant only has to fail; shrinking its failing example
to a minimal one would cost most of the self-test's time."""

from hypothesis import Phase, settings


def pytest_configure(config) -> None:
    settings.register_profile("selftest-no-shrink", parent=settings.default,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("selftest-no-shrink")
