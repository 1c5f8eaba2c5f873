"""tower_train.training.progress in this process, driven by scripted update events (their wall times
given, not measured): the log lines and their examples/sec, the TensorBoard scalars read back
from the event file, the live line's rate, and summaries turned off when their directory cannot
be made. Every rate is checked against the hand computation global batch x timed updates / their
seconds."""
import glob
import logging
import types

import pytest
import tensorflow as tf

from tower_train.config import TrainConfig
from tower_train.training.progress import Progress, Summaries, new_history
from tower_train.training.hooks import UpdateEvent

GLOBAL_BATCH = 64
LEARNING_RATE = 0.25
# Wall times of updates 1..7; the first one traces, so it is never timed.
SECONDS = [9.0, 0.5, 1.5, 0.25, 0.25, 0.5, 2.0]


def fake_state(loss_scale: float | None = None):
    """What Progress reads of a TrainState: the optimizer's rate and, in float16, the loss scale."""
    scale = None if loss_scale is None else types.SimpleNamespace(value=tf.Variable(loss_scale))
    return types.SimpleNamespace(optimizer=types.SimpleNamespace(learning_rate=LEARNING_RATE),
                                 loss_scale=scale)


def run(progress: Progress, state, steps=range(1, 8)) -> list[float]:
    losses = []
    for step in steps:
        losses.append(2.0 / step)
        progress.after_update(UpdateEvent(step, losses[-1], SECONDS[step - 1], state))
    progress.close()
    return losses


def read_scalars(directory) -> dict[int, dict[str, float]]:
    scalars = {}
    for path in glob.glob(f"{directory}/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(event.step, {})[value.tag] = float(tf.make_ndarray(value.tensor))
    return scalars


def rate(steps) -> float:
    """examples/sec over updates `steps`, by hand."""
    return GLOBAL_BATCH * len(steps) / sum(SECONDS[s - 1] for s in steps)


def make_progress(tmp_path, log, live=False, first_step=0, summaries=None, history=None) -> Progress:
    config = TrainConfig(train_dir=str(tmp_path), log_every=3, max_steps=7)
    return Progress(config=config, global_batch=GLOBAL_BATCH, first_step=first_step,
                    summaries=summaries if summaries is not None else Summaries(str(tmp_path)),
                    log=log, live=live, history=history if history is not None else new_history())


def test_log_lines_come_after_the_first_update_every_log_every_and_at_max_steps(tmp_path):
    lines = []
    losses = run(make_progress(tmp_path, lambda text, *args: lines.append(text % args)), fake_state())
    assert lines == [
        f"step 1, loss = {losses[0]:.4f} (warm-up: tracing, not timed)",
        # updates 2 and 3: 128 examples in 2 s
        f"step 3, loss = {losses[2]:.4f} ({rate([2, 3]):.1f} examples/sec; {2.0 / 2:.3f} sec/update)",
        f"step 6, loss = {losses[5]:.4f} ({rate([4, 5, 6]):.1f} examples/sec; {1.0 / 3:.3f} sec/update)",
        f"step 7, loss = {losses[6]:.4f} ({rate([7]):.1f} examples/sec; {2.0:.3f} sec/update)",
    ]
    assert rate([2, 3]) == 64.0 and rate([4, 5, 6]) == 192.0 and rate([7]) == 32.0


def test_tensorboard_gets_loss_rate_and_examples_per_sec_of_the_updates_since_the_last_write(tmp_path):
    summaries, history = Summaries(str(tmp_path)), new_history()
    losses = run(make_progress(tmp_path, lambda *_: None, summaries=summaries, history=history),
                 fake_state())
    summaries.close()
    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == [3, 6, 7]
    for step, timed in [(3, [2, 3]), (6, [4, 5, 6]), (7, [7])]:
        assert scalars[step] == pytest.approx({"loss": losses[step - 1], "learning_rate": LEARNING_RATE,
                                               "examples_per_sec": rate(timed)}, rel=1e-6), step
    # fit's TrainResult.history holds the same points (no held-out evaluation here)
    assert history["step"] == [3, 6, 7]
    assert history["loss"] == pytest.approx([losses[2], losses[5], losses[6]], rel=1e-6)
    assert history["learning_rate"] == pytest.approx([LEARNING_RATE] * 3)
    assert history["val_step"] == history["val_precision"] == []


def test_in_float16_the_loss_scale_is_logged_and_written(tmp_path):
    lines, summaries = [], Summaries(str(tmp_path))
    run(make_progress(tmp_path, lambda text, *args: lines.append(text % args), summaries=summaries),
        fake_state(loss_scale=1024.0), steps=range(1, 4))
    summaries.close()
    assert lines[0].endswith(", loss scale 1024 (warm-up: tracing, not timed)")
    assert f", loss scale 1024 ({rate([2, 3]):.1f} examples/sec;" in lines[1]
    assert read_scalars(tmp_path)[3]["loss_scale"] == 1024.0


def test_a_resumed_process_times_from_its_own_second_update(tmp_path):
    lines = []
    run(make_progress(tmp_path, lambda text, *args: lines.append(text % args), first_step=4),
        fake_state(), steps=range(5, 8))
    # Update 5 is this process's first: untimed, logged; 6 is due (6 % 3) with itself alone timed.
    assert [line.split(" (")[1] for line in lines] == [
        "warm-up: tracing, not timed)", f"{rate([6]):.1f} examples/sec; 0.500 sec/update)",
        f"{rate([7]):.1f} examples/sec; 2.000 sec/update)"]


def test_the_live_line_shows_the_rate_of_every_timed_update_and_no_log_lines(tmp_path, capsys):
    lines = []
    run(make_progress(tmp_path, lambda text, *args: lines.append(text % args), live=True), fake_state())
    assert lines == []
    shown = capsys.readouterr().err
    assert f"examples/s={rate(range(2, 8)):.1f}" in shown  # 384 examples in 5 s
    assert "7/7" in shown


def test_summaries_whose_directory_cannot_be_made_turn_off_with_one_warning(tmp_path, caplog):
    """(A write that fails later, on a full disk, is test_reliability.py's.)"""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        summaries = Summaries(str(blocker / "train_dir"))
        summaries.scalars(1, {"loss": 1.0})
        summaries.scalars(2, {"loss": 0.5})
        summaries.close()
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard summaries are off" in r.getMessage()]
    assert len(warnings) == 1 and str(blocker / "train_dir") in warnings[0], caplog.text
    assert blocker.read_text() == "not a directory"


def test_a_held_out_evaluation_goes_to_the_history_and_tensorboard_at_its_step(tmp_path):
    summaries, history = Summaries(str(tmp_path)), new_history(["auc"])
    progress = make_progress(tmp_path, lambda *_: None, summaries=summaries, history=history)
    progress.after_evaluation(2, {"val_precision": 0.5, "val_loss": 1.25, "val_auc": 0.75})
    progress.after_evaluation(5, {"val_precision": 0.625, "val_loss": 1.0, "val_auc": 0.875})
    summaries.close()
    assert {key: history[key] for key in ("val_step", "val_precision", "val_loss", "val_auc")} == {
        "val_step": [2, 5], "val_precision": [0.5, 0.625], "val_loss": [1.25, 1.0],
        "val_auc": [0.75, 0.875]}
    assert history["step"] == history["loss"] == []
    assert read_scalars(tmp_path) == {2: {"val_precision": 0.5, "val_loss": 1.25, "val_auc": 0.75},
                                      5: {"val_precision": 0.625, "val_loss": 1.0, "val_auc": 0.875}}
