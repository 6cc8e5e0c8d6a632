"""Which class of g2p's decoding work an instance steps next, greedy words or a beam search: weighted-fair
by cost (service.scheduling.continuous steps the two in turn)."""

from __future__ import annotations

from typing import Literal

__all__ = ["BEAM", "GREEDY", "FairShare", "Work"]

Work = Literal["greedy", "beam"]
GREEDY: Work = "greedy"
BEAM: Work = "beam"


class FairShare:
    """Which class of work an instance steps next: greedy or beam, weighted-fair by cost.

    A step's cost is its rows (a beam search's: words still searching x beams), about the compute it
    takes. While both classes have work, the one served less cost goes next, a tie to greedy (its
    steps are the short ones). Only steps taken while both had work are counted, and the count
    restarts whenever one has none: a class banks no credit while the other runs alone. So neither
    is ever more than one step's cost ahead of the other: between two of its steps, a greedy batch
    waits for at most (largest greedy step + largest beam step) of beam cost, and a beam search as
    much of greedy cost.
    """

    __slots__ = ("contended", "lead")

    def __init__(self) -> None:
        self.lead = 0  # cost served to beam work minus cost served to greedy work, while both had work
        self.contended = False  # whether both had work at the last choice

    def choose(self, greedy: bool, beam: bool) -> Work | None:
        """The class to step next, given whether each has work now; None when neither has."""
        self.contended = greedy and beam
        if not self.contended:
            self.lead = 0
            return GREEDY if greedy else BEAM if beam else None
        return GREEDY if self.lead >= 0 else BEAM

    def charge(self, work: Work, cost: int) -> None:
        """A step of `work` of `cost` rows ran (the one chosen last)."""
        if self.contended:
            self.lead += cost if work == BEAM else -cost
