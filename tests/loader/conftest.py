"""Every loader test runs with the plain CPU copier and through the stand-in device
(``tests/fixtures/device.py``)."""

from __future__ import annotations

import pytest
from modelpack.loader.device_standin import StandinDevice

from tests.fixtures.device import parametrize_copier


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_copier(metafunc)


@pytest.fixture(autouse=True)
def _every_copier(copier: StandinDevice | None) -> StandinDevice | None:
    return copier
