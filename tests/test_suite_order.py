"""The suite's own collection order (tests/conftest.py): the long pytest-xdist groups first."""

from __future__ import annotations

import pytest

from conftest import FIRST_GROUPS, pytest_collection_modifyitems


class _Item:
    def __init__(self, name: str, group: str | None) -> None:
        self.name, self.group = name, group
        self.markers: list = []

    def get_closest_marker(self, name: str):
        if name == "xdist_group" and self.group is not None:
            return pytest.mark.xdist_group(self.group).mark
        return None

    def add_marker(self, marker) -> None:
        self.markers.append(marker)


def test_the_long_groups_come_first_in_their_order_the_rest_as_collected():
    items = [_Item("a", None), _Item("b", "cli-usage"), _Item("c", "other"),
             _Item("d", "tensor-parallel"), _Item("e", None), _Item("f", "cli-usage")]
    pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert FIRST_GROUPS == ("tensor-parallel", "cli-usage")
    assert [i.name for i in items] == ["d", "b", "f", "a", "c", "e"]
