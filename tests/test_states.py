import pytest

from jobs import states


@pytest.mark.parametrize(
    "current,target",
    [
        ("queued", "starting"),
        ("starting", "running"),
        ("running", "succeeded"),
        ("running", "failed"),
        ("running", "stopped"),
        ("running", "cancelled"),
        ("queued", "cancelled"),
        ("running", "queued"),  # requeued: node lost
        ("starting", "queued"),
    ],
)
def test_allowed_transitions(current, target):
    states.check(current, target)


@pytest.mark.parametrize(
    "current,target",
    [
        ("queued", "running"),  # compute must be held first
        ("queued", "succeeded"),
        ("succeeded", "running"),
        ("cancelled", "queued"),
        ("failed", "succeeded"),
        ("stopped", "running"),
    ],
)
def test_refused_transitions(current, target):
    with pytest.raises(states.InvalidTransition, match=f"a {current} job cannot become {target}"):
        states.check(current, target)


def test_terminal_states_lead_nowhere():
    for state in states.TERMINAL:
        assert states.TRANSITIONS[state] == set()
