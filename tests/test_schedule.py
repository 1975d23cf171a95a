from shardwire.engine.schedule import Pass


class FakeUnit:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


UNITS = [FakeUnit(f"u{i}") for i in range(6)]


def walk(expected, window, run):
    """Events of a pass: ('gather', unit) from the prefetcher and ('run', unit) as units start."""
    events = []
    p = Pass(expected, window, lambda unit: events.append(("gather", unit)))
    for unit in run:
        events.append(("run", unit))
        p.enter(unit)
    return p, events


def test_first_pass_records_and_prefetches_nothing():
    p, events = walk(None, 2, UNITS)
    assert events == [("run", u) for u in UNITS]
    assert p.changed_order() and p.seen == UNITS


def test_window_slides_one_unit_at_a_time():
    p, events = walk(UNITS, 2, UNITS)
    u = UNITS
    assert events == [
        ("gather", u[0]), ("gather", u[1]),
        ("run", u[0]), ("gather", u[2]),
        ("run", u[1]), ("gather", u[3]),
        ("run", u[2]), ("gather", u[4]),
        ("run", u[3]), ("gather", u[5]),
        ("run", u[4]),
        ("run", u[5]),
    ]
    assert not p.changed_order()


def test_never_more_than_window_ahead():
    for window in range(5):
        _, events = walk(UNITS, window, UNITS)
        started, issued = 0, 0
        for kind, _ in events:
            started += kind == "run"
            issued += kind == "gather"
            assert issued - started <= window


def test_a_changed_order_stops_prefetching_and_is_recorded():
    new_order = [UNITS[0], UNITS[2], UNITS[1], *UNITS[3:]]
    p, events = walk(UNITS, 1, new_order)
    gathers = [unit for kind, unit in events if kind == "gather"]
    assert gathers == [UNITS[0], UNITS[1]]  # nothing after the departure at position 1
    assert p.changed_order() and p.seen == new_order


def test_a_shorter_pass_is_a_changed_order():
    p, _ = walk(UNITS, 1, UNITS[:4])
    assert p.changed_order()
