"""pytest settings of tests/python: a skipped test is a failure (a test that cannot run must not
pass silently), and gdntrain's modules must come from this checkout."""
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped tests count as failures here: {report.longrepr}"
