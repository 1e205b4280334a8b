"""A pytest plugin (tests/conftest.py loads it): a trio test's skip and xfail keep their reason.

pytest-trio 0.8 runs a test inside ``trio.run``, where ``pytest.skip(reason)`` reaches it wrapped in an
exception group; it unwraps it by raising a bare ``pytest.skip()``, so the summary says "Skipped" and not
why (the chaos disk-full scenario where mount is refused, a real test without its build).  The bare
outcome's context is that group: its one leaf is raised in its place.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
from _pytest.outcomes import Skipped, XFailed


def _single_leaf(group: BaseException | None) -> BaseException | None:
    """The one exception inside ``group`` and its nested groups, or None where there are more or none."""
    leaves: list[BaseException] = []
    queue = [group] if isinstance(group, BaseExceptionGroup) else []
    while queue:
        for exception in queue.pop().exceptions:
            if isinstance(exception, BaseExceptionGroup):
                queue.append(exception)
            else:
                leaves.append(exception)
    return leaves[0] if len(leaves) == 1 else None


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    try:
        return (yield)
    except (Skipped, XFailed) as outcome:
        leaf = _single_leaf(outcome.__context__)
        if type(leaf) is type(outcome) and not str(outcome):
            raise leaf from None
        raise
