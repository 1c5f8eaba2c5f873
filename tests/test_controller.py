"""The Controller (controller.py's outer loop) in this process, around a scripted inner step: the
update count, the checkpoint cadence, the hooks, refused updates (total weight 0, non-finite,
fp16 overflow) and --max_skipped, non-finite state after an applied update, op errors, stop
signals and a peer's stop. The state, its checkpoints and the stop mechanism are the real ones;
only what one update computes is scripted."""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import signal
import types
from typing import Callable, Iterator

import keras
import pytest
import tensorflow as tf

from tower_train.training import checkpoints
from tower_train.training import run_record
from tower_train.training import controller
from tower_train.config import TrainConfig
from tower_train.errors import Stopped, TrainingError
from tower_train.training.hooks import Hook, UpdateEvent
from tower_train.step.inner_step import Decision, UpdateResult
from tower_train.models import TowerModel
from tower_train.workers.peer_watchdog import PeerClock
from tower_train.training.run import TrainState
from tower_train.step.schedules import MovingAverage
from tower_train.training.stop_signals import StopSignals
from tower_train.step.update_rule import LossScale

WEIGHT = 16.0  # W of every update that counts labels
NAN, INF = math.nan, math.inf


def applied(loss: float) -> UpdateResult:
    return UpdateResult(loss, WEIGHT, Decision.APPLIED)


def non_finite(loss: float) -> UpdateResult:
    return UpdateResult(loss, WEIGHT, Decision.NONFINITE)


EMPTY = UpdateResult(0.0, 0.0, Decision.EMPTY)  # every weight 0: the strategy step's loss is then 0 (+ reg.)
OVERFLOW = UpdateResult(2.5, WEIGHT, Decision.OVERFLOW)  # fp16: a finite loss, a gradient that overflowed


class Tiny(TowerModel):
    def __init__(self, **kwargs):
        super().__init__(num_classes=2, **kwargs)
        self.logits = keras.layers.Dense(2)

    def call(self, features, training=False):
        return self.logits(features)


def tiny_state(fp16: bool = False) -> TrainState:
    """A real TrainState, as small as one: a Dense(2) model, SGD with a momentum slot, the
    moving average, and fp16's loss scale when asked."""
    model = Tiny()
    model(tf.zeros([1, 3]))
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    counter = dict(dtype=tf.int64, trainable=False)
    return TrainState(model, optimizer, tf.Variable(0, **counter),
                              tf.Variable(0, **counter),
                              MovingAverage(model.trainable_variables, 0.99),
                              LossScale() if fp16 else None)


class RecordingClock(PeerClock):
    """A watchdog that counts progress points and notes whether it is inside local work."""

    def __init__(self):
        self.progress_points = 0
        self.in_local_work = False

    def progress(self) -> None:
        self.progress_points += 1

    @contextlib.contextmanager
    def local_work(self) -> Iterator[None]:
        self.in_local_work = True
        try:
            yield
        finally:
            self.in_local_work = False


class WatchedResult(UpdateResult):
    """A scripted update's result that notes, in `order`, when the Controller first reads it."""

    __slots__ = ("number", "order")

    def __init__(self, result: UpdateResult, number: int, order: list[tuple[str, int]]):
        super().__init__(result.loss, result.total_weight, result.decision, result.state_finite)
        self.number, self.order = number, order

    def _values(self):
        if self._read is None:
            self.order.append(("read", self.number))
        return super()._values()


class ScriptedStep:
    """An InnerStep that plays `script`, one UpdateResult per update, as a mode's step would:
    it takes K micro-batches, counts an applied update in `state.step` and, with fp16, halves
    the loss scale for a refused update that had labels (an empty one never lowers it).
    `during[n]` runs inside the n-th call (a signal arriving, weights going bad, an op error).
    `order` notes each call ("run", n) and the Controller's first read of its result ("read", n)."""

    overlaps_updates = True

    def __init__(self, state: TrainState, accum: int, script: list[UpdateResult],
                 clock: RecordingClock, during: dict[int, Callable[[], None]] | None = None):
        self.state, self.accum, self.script, self.clock = state, accum, list(script), clock
        self.during = during or {}
        self.calls: list[dict] = []
        self.syncs: list[tuple] = []  # at each sync_state: the step, and the checkpoints saved by then
        self.written: list[int] = []  # the step at each state_written
        self.saved: Callable[[], list[int]] = list
        self.held_is_finite = True
        self.order: list[tuple[str, int]] = []

    def run_update(self, batches, at_once=None):
        taken = [next(batches) for _ in range(self.accum)]
        self.calls.append(dict(step_before=int(self.state.step.numpy()), batches=taken,
                               local_work=self.clock.in_local_work, at_once=at_once))
        if len(self.calls) in self.during:
            self.during[len(self.calls)]()
        assert len(self.calls) <= len(self.script), "the Controller asked for more updates than scripted"
        result = self.script[len(self.calls) - 1]
        if result.applied:
            self.state.step.assign_add(1)
            # As a mode's update reports it, read after its apply (UpdateRule.state_finite).
            result = result.with_state_finite(self.state.all_finite())
        elif self.state.loss_scale is not None and result.decision != Decision.EMPTY:
            self.state.loss_scale.after_refused()
        self.order.append(("run", len(self.calls)))
        return WatchedResult(result, len(self.calls), self.order)

    def traced_update(self, spec):
        raise NotImplementedError  # the Controller never traces

    def sync_state(self):
        self.syncs.append((int(self.state.step.numpy()), tuple(self.saved())))

    def state_written(self):
        self.written.append(int(self.state.step.numpy()))

    def held_finite(self):
        return self.held_is_finite

    def variable_roles(self):
        raise NotImplementedError


class RecordingHook(Hook):
    def __init__(self):
        self.events: list[UpdateEvent] = []
        self.heard: list[tuple] = []  # every call but after_update's event: (method, arguments)

    def train_begin(self) -> None:
        self.heard.append(("train_begin",))

    def update_begin(self, step: int) -> None:
        self.heard.append(("update_begin", step))

    def after_update(self, event: UpdateEvent) -> None:
        self.events.append(event)
        self.heard.append(("after_update", event.step))

    def after_evaluation(self, step: int, held_out) -> None:
        self.heard.append(("after_evaluation", step, dict(held_out)))

    def train_end(self) -> None:
        self.heard.append(("train_end",))

    def close(self) -> None:
        raise AssertionError("the Controller does not close its hooks: train() does")


class Run:
    """A Controller on a tiny real state, real checkpoints in `train_dir`, and a scripted step."""

    def __init__(self, train_dir, script: list[UpdateResult], fp16: bool = False,
                 during: dict[int, Callable[[], None]] | None = None,
                 stop: StopSignals | None = None, any_worker: Callable[[bool], bool] = bool,
                 hooks: int | list[Hook] = 2, overlaps: bool = True, **overrides):
        self.train_dir = str(train_dir)
        self.config = TrainConfig(**{"train_dir": self.train_dir, "num_gpus": 1, "batch_size": 4,
                                     "precision": "fp16" if fp16 else "fp32", **overrides})
        self.state = tiny_state(fp16)
        self.writer = checkpoints.CheckpointWriter(
            self.state.checkpoint(), self.train_dir,
            run_record.RunRecord("tiny", None, "none", 0, "momentum", self.config.global_batch, True))
        assert self.writer.restore(self.state.all_finite) is None  # a fresh train_dir
        self.clock = RecordingClock()
        self.inner = ScriptedStep(self.state, self.config.accum, script, self.clock, during)
        self.inner.overlaps_updates = overlaps
        self.inner.saved = self.saved
        self.hooks = hooks if isinstance(hooks, list) else [RecordingHook() for _ in range(hooks)]
        self.logged: list[str] = []
        self.controller = controller.Controller(
            config=self.config, state=self.state, inner=self.inner, batches=itertools.count(),
            writer=self.writer, hooks=self.hooks, global_batch=self.config.global_batch,
            log=lambda message, *args: self.logged.append(message % args), stop=stop,
            any_worker=any_worker, watchdog=self.clock)

    def saved(self) -> list[int]:
        """The numbers of the checkpoints in train_dir, from their files."""
        return sorted(int(re.fullmatch(r"ckpt-(\d+)\.index", name).group(1))
                      for name in os.listdir(self.train_dir) if re.fullmatch(r"ckpt-\d+\.index", name))

    def ckpt(self, number: int) -> str:
        return os.path.join(self.train_dir, f"ckpt-{number}")

    def hook_steps(self) -> list[list[int]]:
        return [[event.step for event in hook.events] for hook in self.hooks]


def saved_value(prefix: str, name: str) -> int:
    return int(tf.train.load_variable(prefix, f"{name}/.ATTRIBUTES/VARIABLE_VALUE"))


def test_a_run_counts_its_updates_saves_at_the_cadence_and_at_the_end_and_calls_each_hook(tmp_path):
    losses = [4.0, 3.5, 3.25, 3.0, 2.75]
    run = Run(tmp_path, [applied(loss) for loss in losses], max_steps=5, checkpoint_every=2, accum=3)
    g = 4 * 1 * 3  # batch_size x towers x accum

    assert run.controller.run() == 2.75
    # One call per update, each on the next K = 3 micro-batches of the stream.
    assert [call["step_before"] for call in run.inner.calls] == [0, 1, 2, 3, 4]
    assert [call["batches"] for call in run.inner.calls] == [[0, 1, 2], [3, 4, 5], [6, 7, 8],
                                                             [9, 10, 11], [12, 13, 14]]
    assert int(run.state.step.numpy()) == 5 and int(run.state.examples_seen.numpy()) == 5 * g
    # Every 2 updates, and at the last (5); each holds the state of its update.
    assert run.saved() == [2, 4, 5]
    # The state is made current before each save reads it; no callback, so nothing was written.
    assert run.inner.syncs == [(2, ()), (4, (2,)), (5, (2, 4))] and run.inner.written == []
    for number in (2, 4, 5):
        assert saved_value(run.ckpt(number), "step") == number
        assert saved_value(run.ckpt(number), "examples_seen") == number * g
    assert run.controller.last_checkpoint == run.ckpt(5)
    for hook in run.hooks:
        assert [(e.step, e.loss) for e in hook.events] == list(zip([1, 2, 3, 4, 5], losses))
        assert all(e.state is run.state for e in hook.events)
    # Only the first update of the process (the one that traces) is local work for the watchdog,
    # which hears of every micro-step (5 x 3), update (5) and save (3).
    assert [call["local_work"] for call in run.inner.calls] == [True, False, False, False, False]
    assert run.clock.progress_points == 5 * 3 + 5 + 3


class Evaluates(RecordingHook):
    """Evaluates after update 2: hands back its held-out values."""

    def after_update(self, event: UpdateEvent):
        super().after_update(event)
        return {"val_loss": 0.25 * event.step} if event.step == 2 else None


class UserHook(RecordingHook):
    """A hook of the user's code, which asks to stop after update `stop_after`."""

    user_code = True

    def __init__(self, stop_after: int):
        super().__init__()
        self.stop_after = stop_after

    def stop_asked(self):
        return "UserHook" if self.events and self.events[-1].step == self.stop_after else None


def test_held_out_values_a_hook_returns_reach_every_hook_and_a_user_hook_stops_the_run_saved(tmp_path):
    before, evaluates, user = RecordingHook(), Evaluates(), UserHook(stop_after=3)
    run = Run(tmp_path, [applied(loss) for loss in (3.0, 2.0, 1.0, 0.5)], hooks=[before, evaluates, user],
              max_steps=4, checkpoint_every=100)

    assert run.controller.run() == 1.0
    update = [[("update_begin", step), ("after_update", step)] for step in (1, 2, 3)]
    told = [("train_begin",), *update[0], *update[1], ("after_evaluation", 2, {"val_loss": 0.5}),
            *update[2]]
    # The hook before the one that evaluated hears of it too, after every hook's after_update.
    assert before.heard == evaluates.heard == user.heard == told
    assert run.controller.last_evaluated == 2
    # Stopped at the boundary of update 3, saved; the user's hook ran on the current state
    # (made current before each call, marked written after).
    assert run.saved() == [3]
    assert run.logged[-1] == f"UserHook set model.stop_training: stopped after update 3, saved {run.ckpt(3)}"
    assert [step for step, _ in run.inner.syncs] == [0, 0, 1, 1, 2, 2, 2, 3, 3]  # the last: the save
    assert run.inner.written == [0, 0, 1, 1, 2, 2, 2, 3]
    run.controller.end()
    assert user.heard[-1] == before.heard[-1] == ("train_end",)


def test_a_run_already_at_max_steps_trains_nothing_and_writes_nothing(tmp_path):
    run = Run(tmp_path, [], max_steps=3)
    run.state.step.assign(3)

    assert run.controller.run() is None
    assert run.inner.calls == [] and run.saved() == []
    assert run.logged == ["step 3 already reaches --max_steps=3: nothing to train"]


def test_an_update_of_total_weight_0_is_passed_over_and_does_not_count_toward_max_steps(tmp_path):
    # --nonfinite=stop and --max_skipped=2: one empty update at a time is neither a fault nor a stop.
    script = [applied(3.0), EMPTY, applied(2.0), EMPTY, applied(1.0)]
    run = Run(tmp_path, script, max_steps=3, checkpoint_every=100, max_skipped=2, nonfinite="stop")

    assert run.controller.run() == 1.0
    assert len(run.inner.calls) == 5 and int(run.state.step.numpy()) == 3
    assert int(run.state.examples_seen.numpy()) == 5 * 4  # the empty updates' examples are passed over
    assert run.hook_steps() == [[1, 2, 3]] * 2
    assert run.saved() == [3]
    assert saved_value(run.ckpt(3), "examples_seen") == 5 * 4
    assert [line for line in run.logged if "total weight 0" in line] == [
        f"update {n} has total weight 0 (every label weighs 0) and was not applied; its examples "
        "are passed over" for n in (2, 3)]


def test_fewer_than_max_skipped_empty_updates_in_a_row_go_on(tmp_path):
    script = [EMPTY, EMPTY, applied(2.0), EMPTY, EMPTY, applied(1.0)]
    run = Run(tmp_path, script, max_steps=2, max_skipped=3)

    assert run.controller.run() == 1.0
    assert len(run.inner.calls) == 6 and run.hook_steps() == [[1, 2]] * 2


def test_max_skipped_empty_updates_in_a_row_end_the_run_naming_the_last_good_checkpoint(tmp_path):
    run = Run(tmp_path, [applied(2.0), EMPTY, EMPTY, EMPTY], max_steps=10, checkpoint_every=1,
              max_skipped=3)

    with pytest.raises(TrainingError) as raised:
        run.controller.run()
    g = 4
    assert str(raised.value) == (
        f"3 updates in a row had total weight 0, up to stream position {4 * g}: that reaches "
        f"--max_skipped=3 (the data's weights are all 0 there); the last good checkpoint is "
        f"{run.ckpt(1)}")
    assert len(run.inner.calls) == 4 and int(run.state.step.numpy()) == 1
    assert run.saved() == [1]


@pytest.mark.parametrize("bad_loss", [NAN, INF])
def test_a_non_finite_update_under_nonfinite_stop_ends_the_run_unsaved(tmp_path, bad_loss):
    run = Run(tmp_path, [applied(3.0), applied(2.0), non_finite(bad_loss)],
              max_steps=10, checkpoint_every=1, nonfinite="stop")

    with pytest.raises(TrainingError) as raised:
        run.controller.run()
    assert str(raised.value) == (
        f"update 3 has a non-finite loss or gradient (loss = {bad_loss}) and was not applied; "
        f"stopping (--nonfinite=stop); the last good checkpoint is {run.ckpt(2)}")
    assert run.saved() == [1, 2] and run.hook_steps() == [[1, 2]] * 2


def test_a_non_finite_first_update_says_no_checkpoint_was_written(tmp_path):
    run = Run(tmp_path, [non_finite(NAN)], max_steps=10)

    with pytest.raises(TrainingError, match="the last good checkpoint is none: no checkpoint was "
                                            "written yet$"):
        run.controller.run()
    assert run.saved() == []


def test_non_finite_updates_under_nonfinite_skip_are_skipped_and_counted(tmp_path):
    bad = non_finite(NAN)
    script = [bad, applied(3.0), bad, bad, applied(2.0), bad, applied(1.0)]
    run = Run(tmp_path, script, max_steps=3, nonfinite="skip", max_skipped=3)

    assert run.controller.run() == 1.0
    assert len(run.inner.calls) == 7 and int(run.state.step.numpy()) == 3
    assert int(run.state.examples_seen.numpy()) == 7 * 4
    assert run.hook_steps() == [[1, 2, 3]] * 2
    # (update, in a row, in all), from the script: the bad ones are updates 1, 2, 2 and 3.
    expected = [(1, 1, 1), (2, 1, 2), (2, 2, 3), (3, 1, 4)]
    assert [line for line in run.logged if "skipped (" in line] == [
        f"update {update} has a non-finite loss or gradient (loss = nan) and was not applied; "
        f"skipped ({row} in a row, {total} in all)" for update, row, total in expected]


def test_max_skipped_non_finite_updates_in_a_row_end_the_run_under_nonfinite_skip(tmp_path):
    bad = non_finite(INF)
    run = Run(tmp_path, [applied(3.0), bad, bad, bad], max_steps=10, checkpoint_every=1,
              nonfinite="skip", max_skipped=3)

    with pytest.raises(TrainingError) as raised:
        run.controller.run()
    assert str(raised.value) == (
        "update 2 has a non-finite loss or gradient (loss = inf) and was not applied; 3 updates in "
        f"a row skipped reaches --max_skipped=3; the last good checkpoint is {run.ckpt(1)}")
    assert len(run.inner.calls) == 4 and run.saved() == [1]


def test_fp16_overflows_are_skipped_whatever_nonfinite_and_max_skipped_say(tmp_path):
    # 3 overflows in a row under --nonfinite=stop and --max_skipped=2: none of them is a fault.
    run = Run(tmp_path, [OVERFLOW, OVERFLOW, OVERFLOW, applied(2.0)], fp16=True, max_steps=1,
              nonfinite="stop", max_skipped=2)

    assert run.controller.run() == 2.0
    assert len(run.inner.calls) == 4 and run.hook_steps() == [[1]] * 2
    assert float(run.state.loss_scale.value.numpy()) == 2.0 ** 15 / 2 ** 3
    assert [line for line in run.logged if "overflow" in line] == [
        f"update 1: float16 gradient overflow; update skipped, loss scale lowered to {scale}"
        for scale in (16384, 8192, 4096)]


@pytest.mark.parametrize("where", ["weights", "optimizer slots", "moving average", "the step's slices"])
def test_an_applied_update_that_leaves_non_finite_state_stops_the_run_unsaved(tmp_path, where):
    def poison():
        if where == "the step's slices":  # --ps_device=spread keeps the state away from the TrainState
            run.inner.held_is_finite = False
            return
        state = run.state
        variables = {"weights": state.model.trainable_variables,
                     "optimizer slots": [v for v in state.optimizer.variables if "momentum" in v.path],
                     "moving average": state.moving_average.averages}[where]
        assert variables
        variables[0].assign(tf.fill(variables[0].shape, math.inf))

    # --nonfinite=skip: an applied update cannot be taken back, so it stops whatever that says.
    run = Run(tmp_path, [applied(3.0), applied(1.5), applied(1.0)], during={2: poison},
              max_steps=3, checkpoint_every=1, nonfinite="skip")

    with pytest.raises(TrainingError) as raised:
        run.controller.run()
    assert str(raised.value) == (
        "update 2 had a finite loss (1.5) and gradient but left non-finite values in the weights "
        "or the optimizer's state (a learning rate too large, or the optimizer overflowed); "
        f"stopping without saving them; the last good checkpoint is {run.ckpt(1)}")
    assert run.saved() == [1] and run.hook_steps() == [[1]] * 2


@pytest.mark.parametrize("describe", [None, lambda e: f"in shard-3.tfrecord: {e.message}"])
def test_an_op_error_in_an_update_is_one_training_error_naming_the_last_good_checkpoint(
        tmp_path, describe):
    def fail():
        raise tf.errors.InvalidArgumentError(None, None, "label 12 is outside 0..9")

    run = Run(tmp_path, [applied(3.0), applied(2.0)], during={2: fail}, max_steps=2,
              checkpoint_every=1)
    if describe is not None:
        run.controller.describe_error = describe

    with pytest.raises(TrainingError) as raised:
        run.controller.run()
    where = "" if describe is None else "in shard-3.tfrecord: "
    assert str(raised.value) == (f"update 2 failed: {where}label 12 is outside 0..9; the last good "
                                 f"checkpoint is {run.ckpt(1)}")
    assert run.saved() == [1] and int(run.state.step.numpy()) == 1


@pytest.mark.parametrize("number, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130),
                                            (signal.SIGHUP, 129)])
def test_a_stop_signal_stops_at_the_update_boundary_saved(tmp_path, number, status):
    stop, votes = StopSignals(), []

    def vote(local: bool) -> bool:
        votes.append(local)
        return local

    # The signal arrives during update 3; its handler is what the signal would run.
    run = Run(tmp_path, [applied(float(n)) for n in range(5, 0, -1)],
              during={3: lambda: stop._record(number, None)}, stop=stop, any_worker=vote,
              max_steps=5, checkpoint_every=100)

    with pytest.raises(Stopped) as raised:
        run.controller.run()
    name = signal.Signals(number).name
    assert str(raised.value) == (f"stopped by {name} after update 3; saved {run.ckpt(3)}; run the "
                                 "same command to resume")
    assert raised.value.exit_status == status
    assert len(run.inner.calls) == 3 and votes == [False, False, True]
    assert run.saved() == [3] and run.controller.last_checkpoint == run.ckpt(3)
    assert saved_value(run.ckpt(3), "step") == 3
    assert saved_value(run.ckpt(3), "examples_seen") == 3 * 4


# ckpt-2 is written at the stop, past the refused update's examples; or, already written at the
# cadence, it is kept as it was (writing it again would set this run's own ckpt-2 aside as passed over).
@pytest.mark.parametrize("checkpoint_every, examples_in_ckpt_2", [(100, 3 * 4), (2, 2 * 4)])
def test_a_stop_signal_during_a_refused_update_saves_the_last_applied_one(
        tmp_path, checkpoint_every, examples_in_ckpt_2):
    stop = StopSignals()
    run = Run(tmp_path, [applied(3.0), applied(2.0), EMPTY, applied(1.0)],
              during={3: lambda: stop._record(signal.SIGTERM, None)}, stop=stop,
              max_steps=5, checkpoint_every=checkpoint_every)

    with pytest.raises(Stopped, match=re.escape(f"stopped by SIGTERM after update 2; saved "
                                                f"{run.ckpt(2)};")):
        run.controller.run()
    assert len(run.inner.calls) == 3 and run.saved() == [2]
    assert not (tmp_path / checkpoints.PASSED_OVER).exists()
    assert saved_value(run.ckpt(2), "step") == 2
    assert saved_value(run.ckpt(2), "examples_seen") == examples_in_ckpt_2


def test_a_peers_stop_vote_stops_this_worker_saved_at_the_same_boundary(tmp_path):
    votes = []

    def vote(local: bool) -> bool:  # a peer received a signal during update 2
        votes.append(local)
        return len(votes) == 2

    run = Run(tmp_path, [applied(3.0), applied(2.0), applied(1.0)], stop=StopSignals(),
              any_worker=vote, max_steps=3, checkpoint_every=100)

    with pytest.raises(Stopped) as raised:
        run.controller.run()
    assert str(raised.value) == (f"stopped by a peer's signal after update 2; saved {run.ckpt(2)}; "
                                 "run the same command to resume")
    assert raised.value.exit_status == 128 + signal.SIGTERM
    assert votes == [False, False] and run.saved() == [2]


def test_a_long_update_logs_how_far_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(controller, "LONG_UPDATE_NOTE", 0.0)  # every micro-step is "late"
    run = Run(tmp_path, [applied(2.0), applied(1.0)], max_steps=2, accum=2)

    run.controller.run()
    notes = [re.sub(r" \(\d+ s so far\)$", "", line) for line in run.logged if "micro-step" in line]
    assert notes == [f"update {u}: micro-step {m} of 2" for u in (1, 2) for m in (1, 2)]
    # After a long update the next takes its micro-batches one by one, which say how far it is.
    assert [call["at_once"] for call in run.inner.calls] == [None, None]


def test_after_the_first_update_the_step_may_read_an_updates_micro_batches_in_one_call(tmp_path):
    run = Run(tmp_path, [applied(3.0), applied(2.0), applied(1.0)], max_steps=3, accum=2)

    run.controller.run()
    # The first update traces, micro-step by micro-step; the stream itself is offered after it.
    assert [call["at_once"] for call in run.inner.calls] == [None, run.controller.batches, run.controller.batches]


@pytest.mark.parametrize("node", ["while/body/_1/while/IteratorGetNext", "MultiDeviceIteratorGetNextFromShard"])
def test_an_error_of_the_iterator_read_inside_the_update_is_the_input_pipelines(tmp_path, node):
    def input_fails():
        # What TensorFlow raises when a py_function of the stream fails under a get_next in a
        # function: UnknownError, not one of the update's own op errors.
        raise tf.errors.UnknownError(None, None, "RuntimeError: example 40 is unreadable\n\t "
                                     f"[[{{{{node EagerPyFunc}}}}]]\n\t [[{node}]] [Op:__inference_x_1]")

    run = Run(tmp_path, [applied(3.0), applied(2.0)], max_steps=2, accum=2, during={2: input_fails})

    with pytest.raises(TrainingError) as raised:
        run.controller.run()
    assert str(raised.value) == ("update 2 failed in the input pipeline: RuntimeError: example 40 is "
                                 "unreadable; the last good checkpoint is none")


class ReadsStateEvery(RecordingHook):
    """A hook that reads the training state after every `every`-th update only (as the progress
    log and the held-out evaluation do), so that the Controller may overlap the others."""

    def __init__(self, every: int):
        super().__init__()
        self.every = every

    def reads_state(self, step: int) -> bool:
        return step % self.every == 0


def overlapped_order(reads_now: set[int], last: int) -> list[tuple[str, int]]:
    """The order of runs and reads when update n's result is read after update n + 1 is queued,
    except for the first update and those in `reads_now` (a checkpoint, a hook's read, the last):
    the order that reads nothing on the host between two updates that need nothing."""
    order, in_flight = [], None
    for n in range(1, last + 1):
        order.append(("run", n))
        if in_flight:
            order.append(("read", in_flight))
        in_flight = None if n == 1 or n in reads_now else n
        if in_flight is None:
            order.append(("read", n))
    return order


def test_an_update_is_read_only_after_the_next_is_queued_unless_something_needs_it(tmp_path):
    losses = [4.0, 3.5, 3.25, 3.0, 2.75, 2.5, 2.25, 2.0, 1.75, 1.5]
    hook = ReadsStateEvery(4)
    run = Run(tmp_path, [applied(loss) for loss in losses], hooks=[hook], max_steps=10,
              checkpoint_every=5)

    assert run.controller.run() == 1.5
    # Read at once: the first (it traces), 4 and 8 (the hook reads the state), 5 (a checkpoint)
    # and 10 (the last); every other update is read while the next one runs.
    assert run.inner.order == overlapped_order({4, 5, 8, 10}, 10)
    assert [(e.step, e.loss) for e in hook.events] == list(zip(range(1, 11), losses))
    # Each checkpoint holds the state of its own update, not of the one queued after it.
    assert run.saved() == [5, 10]
    assert [saved_value(run.ckpt(n), "step") for n in (5, 10)] == [5, 10]


def test_a_refused_update_read_late_leaves_its_number_to_the_next(tmp_path):
    script = [applied(4.0), applied(3.0), EMPTY, applied(2.0), applied(1.0), applied(0.5)]
    run = Run(tmp_path, script, hooks=[ReadsStateEvery(100)], max_steps=5, checkpoint_every=100)

    assert run.controller.run() == 0.5
    assert run.inner.order == overlapped_order({6}, 6)
    assert run.hook_steps() == [[1, 2, 3, 4, 5]]
    assert [e.loss for e in run.hooks[0].events] == [4.0, 3.0, 2.0, 1.0, 0.5]
    assert [line for line in run.logged if "total weight 0" in line] == [
        "update 3 has total weight 0 (every label weighs 0) and was not applied; its examples are "
        "passed over"]
    assert run.saved() == [5] and saved_value(run.ckpt(5), "step") == 5


@pytest.mark.parametrize("overlaps", [False, True])
def test_a_non_finite_update_read_late_stops_one_update_later_with_the_same_message(tmp_path, overlaps):
    run = Run(tmp_path, [applied(3.0), applied(2.0), non_finite(NAN), applied(1.0)],
              hooks=[ReadsStateEvery(100)], max_steps=10, checkpoint_every=100, nonfinite="stop",
              overlaps=overlaps)

    with pytest.raises(TrainingError) as raised:
        run.controller.run()
    assert str(raised.value) == ("update 3 has a non-finite loss or gradient (loss = nan) and was not "
                                 "applied; stopping (--nonfinite=stop); the last good checkpoint is "
                                 "none: no checkpoint was written yet")
    assert len(run.inner.calls) == 3 + overlaps and run.saved() == []


def test_a_stop_signal_settles_the_update_in_flight_and_stops_at_its_boundary(tmp_path):
    stop = StopSignals()
    # The signal arrives during update 3, which then stays in flight; its handler is what the
    # signal would run.
    run = Run(tmp_path, [applied(loss) for loss in (4.0, 3.0, 2.0, 1.0, 0.5)], hooks=[ReadsStateEvery(100)],
              during={3: lambda: stop._record(signal.SIGTERM, None)}, stop=stop, max_steps=5,
              checkpoint_every=100)

    with pytest.raises(Stopped, match="^stopped by SIGTERM after update 3; saved "):
        run.controller.run()
    # Update 3 was read before anything else ran, then saved at its boundary; no 4th update.
    assert run.inner.order == overlapped_order(set(), 3) + [("read", 3)]
    assert run.saved() == [3] and saved_value(run.ckpt(3), "step") == 3


def test_overlapped_updates_are_timed_from_the_read_of_the_one_before(tmp_path, monkeypatch):
    # Before: an update queued while the one before ran was timed from its queueing, so the
    # seconds of overlapped updates counted the time between twice, and the log's examples/sec
    # read about half the true rate (the main job: 7.5 s per update logged, 3.9 s taken).
    ticks = []

    def tick() -> float:  # a clock that moves on at every reading
        ticks.append(float(len(ticks)))
        return ticks[-1]

    monkeypatch.setattr(controller, "time", types.SimpleNamespace(perf_counter=tick))
    hook = ReadsStateEvery(100)
    run = Run(tmp_path, [applied(4.0 - step / 10) for step in range(8)], hooks=[hook], max_steps=8,
              checkpoint_every=100)

    run.controller.run()
    assert run.inner.order == overlapped_order({8}, 8)  # every update but the first and last overlapped
    seconds = [event.seconds for event in hook.events]
    assert all(s > 0 for s in seconds)
    assert sum(seconds) <= ticks[-1] - ticks[0]
