"""The two ways a collective fails: it did not complete, or the ranks were not running the same one."""


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message says which rank, op and tag."""


class ScheduleMismatchError(CollectiveError):
    """Ranks issued different collectives at the same point (rank-dependent control flow around units)."""
