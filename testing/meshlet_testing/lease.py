"""A balancer's lease that records what the proxy tells it (http/contract.py's `Lease`)."""

from __future__ import annotations


class RecordingLease:
    """Each call, in order: "responded", "release", "failed"; each outcome reported for
    failure accrual, in order, in `outcomes` (True: a success)."""

    def __init__(self) -> None:
        self.endpoint: object = None  # a balancer's key; none here
        self.events: list[str] = []
        self.outcomes: list[bool] = []

    def responded(self) -> None:
        self.events.append("responded")

    def release(self) -> None:
        self.events.append("release")

    def failed(self) -> None:
        self.events.append("failed")

    def outcome(self, success: bool) -> None:
        self.outcomes.append(success)
