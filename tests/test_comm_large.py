"""Large messages: the byte ranges a tensor travels in and the GEMS_MAX_MESSAGE_BYTES override
in-process; both backends moving tensors in pieces of a tiny limit in one launch
(tests/distributed/comm_large_worker.py, which also checks the MPI backend's posting order while
a staging copy is pending, the staging pool's bound and the torch backend's header check)."""
from __future__ import annotations

import re

import pytest

from gems.comm.base import MAX_MESSAGE_BYTES, byte_ranges, max_message_bytes
from gems.errors import GemsError

from conftest import DISTRIBUTED

WORKER = DISTRIBUTED / "comm_large_worker.py"


@pytest.mark.parametrize("nbytes, limit, ranges", [
    (0, 64, [(0, 0)]),                        # an empty tensor is still one message
    (64, 64, [(0, 64)]),
    (65, 64, [(0, 64), (64, 65)]),
    (740, 64, [(i, min(i + 64, 740)) for i in range(0, 740, 64)]),
    (3 * 2**31, None, [(0, 3 * 2**31)]),      # no limit: large-count MPI
    (2**32, MAX_MESSAGE_BYTES, [(0, MAX_MESSAGE_BYTES), (MAX_MESSAGE_BYTES, 2 * MAX_MESSAGE_BYTES),
                                (2 * MAX_MESSAGE_BYTES, 2**32)]),
])
def test_byte_ranges_cover_the_tensor_in_pieces_of_at_most_the_limit(nbytes, limit, ranges):
    assert byte_ranges(nbytes, limit) == ranges


def test_the_default_limit_fits_a_c_int_and_every_element_size():
    assert MAX_MESSAGE_BYTES < 2**31 - 1 and MAX_MESSAGE_BYTES % 2**20 == 0


def test_gems_max_message_bytes_overrides_the_default(monkeypatch):
    monkeypatch.delenv("GEMS_MAX_MESSAGE_BYTES", raising=False)
    assert max_message_bytes() == MAX_MESSAGE_BYTES and max_message_bytes(None) is None
    monkeypatch.setenv("GEMS_MAX_MESSAGE_BYTES", "4096")
    assert max_message_bytes() == 4096 and max_message_bytes(None) == 4096


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "64k", ""])
def test_a_bad_gems_max_message_bytes_names_the_fix(monkeypatch, value):
    monkeypatch.setenv("GEMS_MAX_MESSAGE_BYTES", value)
    with pytest.raises(GemsError, match=rf"GEMS_MAX_MESSAGE_BYTES must be a positive whole number of bytes, "
                                        rf"got {re.escape(repr(value))}; set it to one .* or unset it"):
        max_message_bytes()


def test_both_backends_move_tensors_in_pieces(run_mpi):
    result = run_mpi(2, WORKER, timeout=60, env={"GEMS_MAX_MESSAGE_BYTES": "64", "GEMS_DEBUG": "1"})
    assert sorted(map(int, re.findall(r"rank (\d+): ok", result.stdout))) == [0, 1], result.tail()
