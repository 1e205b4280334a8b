"""tests/rigs/skips.py: a trio test's skip and xfail reach pytest's summary with their reasons."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CASES = """
import pytest, trio

async def test_skips_at_once():
    pytest.skip("reason one")

async def test_skips_in_a_nursery():
    async with trio.open_nursery():
        pytest.skip("reason two")

async def test_xfails():
    pytest.xfail("reason three")

async def test_skips_bare():
    pytest.skip()

async def test_fails():
    assert 1 == 2
"""


def test_a_trio_tests_skip_and_xfail_keep_their_reasons(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_inprocess(
        "-p", "tests.rigs.skips", "-o", "trio_mode=true", "-rsx", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(skipped=3, xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["SKIPPED * reason one", "SKIPPED * reason two", "XFAIL *test_xfails - reason three"])
