"""Early stopping and the NaN stop: pure checks over metric points."""

from agent.stopping import Watch, as_number, as_stored


def feed(watch, points):
    for step, values in points:
        verdict = watch.add(step, values)
        if verdict is not None:
            return step, verdict
    return None


def test_early_stopping_counts_evaluations_since_the_best():
    watch = Watch(metric="val_loss", mode="min", patience=2)
    step, verdict = feed(watch, [(1, {"val_loss": 1.0}), (2, {"val_loss": 0.5}), (3, {"val_loss": 0.6}), (4, {"val_loss": 0.55}), (5, {"val_loss": 0.1})])
    assert step == 4 and not verdict.failed
    assert verdict.message == "stopped early: val_loss has not improved for 2 evaluations (best 0.5 at step 2)"


def test_higher_is_better_when_the_mode_says_max():
    watch = Watch(metric="acc", mode="max", patience=2)
    assert feed(watch, [(1, {"acc": 0.5}), (2, {"acc": 0.6}), (3, {"acc": 0.7})]) is None
    step, _ = feed(watch, [(4, {"acc": 0.65}), (5, {"acc": 0.69})])
    assert step == 5


def test_points_of_other_series_and_equal_values_do_not_count_as_improvement():
    watch = Watch(metric="val_loss", patience=2)
    assert feed(watch, [(1, {"val_loss": 0.5}), (2, {"loss": 0.1}), (3, {"loss": 0.1}), (4, {"val_loss": 0.5})]) is None
    assert feed(watch, [(5, {"val_loss": 0.5})]) is not None  # equal is not better


def test_a_resumed_run_logging_steps_again_rewinds_instead_of_counting_twice():
    watch = Watch(metric="val_loss", patience=3)
    assert feed(watch, [(10, {"val_loss": 0.5}), (20, {"val_loss": 0.6}), (30, {"val_loss": 0.7})]) is None
    # resumed from the checkpoint at step 15: steps 20 and 30 come again
    assert feed(watch, [(20, {"val_loss": 0.6}), (30, {"val_loss": 0.7})]) is None
    assert feed(watch, [(40, {"val_loss": 0.8})]) is not None


def test_no_patience_no_early_stopping():
    watch = Watch(metric="val_loss", patience=None)
    assert feed(watch, [(i, {"val_loss": float(i)}) for i in range(100)]) is None


def test_a_nan_or_infinite_loss_fails_the_run_unless_turned_off():
    step, verdict = feed(Watch(), [(1, {"loss": 0.3}), (2, {"train_loss": "NaN"})])
    assert step == 2 and verdict.failed and verdict.message.startswith("the train_loss became NaN at step 2")
    _, verdict = feed(Watch(), [(None, {"val_loss": "Infinity"})])
    assert verdict.message.startswith("the val_loss became infinite:")
    assert feed(Watch(), [(1, {"accuracy": "NaN"})]) is None  # only losses
    assert feed(Watch(stop_on_nan=False), [(1, {"loss": "NaN"})]) is None


def test_values_as_numbers():
    assert as_number(1) == 1.0 and as_number("-Infinity") == float("-inf")
    assert as_number(True) is None and as_number("1.5") is None and as_number(None) is None


def test_values_as_stored():
    assert as_stored(0.5) == 0.5 and as_stored(3) == 3.0
    assert as_stored(float("nan")) == "NaN" and as_stored("-Infinity") == "-Infinity" and as_stored(float("inf")) == "Infinity"
    assert as_stored("0.5") is None and as_stored(False) is None
