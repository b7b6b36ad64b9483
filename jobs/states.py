"""The job lifecycle as plain data: which state may follow which.

queued --(compute held: the meter starts)--> starting --> running --> succeeded | failed | stopped
queued/starting/running --> cancelled;  starting/running --(node lost, preempted)--> queued
"""

QUEUED = "queued"
STARTING = "starting"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
STOPPED = "stopped"
CANCELLED = "cancelled"

CHOICES = [
    (QUEUED, "Queued"),
    (STARTING, "Starting"),
    (RUNNING, "Running"),
    (SUCCEEDED, "Succeeded"),
    (FAILED, "Failed"),
    (STOPPED, "Stopped"),
    (CANCELLED, "Cancelled"),
]

TRANSITIONS = {
    QUEUED: {STARTING, CANCELLED, FAILED},
    STARTING: {RUNNING, QUEUED, FAILED, CANCELLED},
    RUNNING: {SUCCEEDED, FAILED, STOPPED, CANCELLED, QUEUED},
    SUCCEEDED: set(),
    FAILED: set(),
    STOPPED: set(),
    CANCELLED: set(),
}

ACTIVE = {QUEUED, STARTING, RUNNING}
HOLDING = {STARTING, RUNNING}  # states in which compute is held and the meter runs
TERMINAL = {SUCCEEDED, FAILED, STOPPED, CANCELLED}


class InvalidTransition(Exception):
    def __init__(self, current, target):
        self.current = current
        self.target = target
        super().__init__(f"a {current} job cannot become {target}")


def check(current, target):
    if target not in TRANSITIONS[current]:
        raise InvalidTransition(current, target)
