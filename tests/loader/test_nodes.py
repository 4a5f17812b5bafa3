"""Ranks per node from torchrun's ``LOCAL_WORLD_SIZE`` (an operator's or a launcher's value): a
value that is not a count of ranks is refused by name, never read as "one node"."""

from __future__ import annotations

import pytest
from modelpack.loader.nodes import node_size, totals_by_node

from modelpack.errors import LoaderError

pytestmark = pytest.mark.host_copier


@pytest.mark.parametrize("raw", ["eight", "-1", "1.5", " ", "0x8"])
def test_a_local_world_size_that_is_not_a_count_of_ranks_is_refused_naming_it(raw: str) -> None:
    with pytest.raises(LoaderError, match="LOCAL_WORLD_SIZE"):
        node_size(0, {"LOCAL_WORLD_SIZE": raw})


def test_the_loaders_own_setting_wins_and_an_unset_variable_means_one_node() -> None:
    assert node_size(4, {"LOCAL_WORLD_SIZE": "eight"}) == 4
    assert node_size(0, {"LOCAL_WORLD_SIZE": "2"}) == 2
    assert node_size(0, {}) == 0


def test_bytes_are_summed_per_node_in_node_order() -> None:
    assert totals_by_node([1, 1, 0, 0], [5, 7, 11, 13]) == [24, 12]
