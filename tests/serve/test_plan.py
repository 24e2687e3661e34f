"""A step plan survives its int64 encoding (what the broadcast carries) and a cut or padded
vector is refused."""

import pytest

from treeattn.serve.plan import Line, Plan


def test_plan_round_trip_and_bad_vectors():
    p = Plan(trims=[(1, 4)], closes=[(2, 0)], drops=[7, 9], prefix=(3, [5, 6, 7]),
             lines=[Line(0, 0, -1, 0, 1, [11, 12, 13]), Line(4, 1, 3, 2, 0, [20])])  # fmt: skip
    v = p.encode()
    q = Plan.decode_from(v)
    assert (q.trims, q.closes, q.drops, q.prefix, q.lines) == (p.trims, p.closes, p.drops, p.prefix, p.lines)
    assert q.lines[1].pid == 3 and q.lines[0].full and q.lines[0].ids == [11, 12, 13]
    assert Plan.decode_from(Plan().encode()).empty()
    with pytest.raises(ValueError, match="cut short"):
        Plan.decode_from(v[:-1])
    with pytest.raises(ValueError, match="left over"):
        Plan.decode_from(v + [0])
