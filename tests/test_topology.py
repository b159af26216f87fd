import pytest

from gems.errors import GemsError
from gems.schedule.topology import Topology


def test_coords_and_groups():
    t = Topology(world=8, stages=4, schedule="1f1b")
    assert t.groups == 2
    assert t.coords(6) == (1, 2) and t.rank(1, 2) == 6
    assert t.sync_group(6) == [2, 6]
    assert t.sync_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.peer(6, 0) == 4


def test_mirror_groups_even_and_odd():
    t = Topology(world=8, stages=4, schedule="mast")
    assert t.holds(1) == [1, 2] and t.holds(2) == [1, 2]
    assert t.sync_group(1) == [1, 2, 5, 6]
    assert t.sync_groups() == [[0, 3, 4, 7], [1, 2, 5, 6]]
    odd = Topology(world=6, stages=3, schedule="mast")
    assert odd.holds(1) == [1]
    assert odd.sync_groups() == [[0, 2, 3, 5], [1, 4]]


def test_single_process():
    t = Topology(world=1, stages=1, schedule="mp")
    assert t.groups == 1 and t.sync_groups() == [[0]]


@pytest.mark.parametrize("world,stages,schedule,match", [
    (6, 4, "mast", "multiple of 4"),
    (4, 0, "mast", "positive integer"),
    (4, 2, "zigzag", "choose one of"),
])
def test_bad_layouts(world, stages, schedule, match):
    with pytest.raises(GemsError, match=match):
        Topology(world=world, stages=stages, schedule=schedule)
