"""The checkpoint an evaluation reads: found from a train_dir's files or named by the user, checked
against the run record beside it, read whole, and restored into the evaluated model (its moving
average too); a checkpoint that a run writing there rotates away meanwhile is `CheckpointGone`.
Training's checkpoints are `checkpoints`'."""
from __future__ import annotations

import dataclasses
import glob
import os
import types

import tensorflow as tf

from tower_train.training.checkpoints import READ_ERRORS, checkpoint_numbers, shape_mismatch
from tower_train.errors import UsageError, first_line
from tower_train.model_spec import model_label
from tower_train.training.run_record import RUN_FILE, RunRecord

# Where a checkpoint holds what evaluation restores.
_MODEL_PREFIX = "model/"
_AVERAGE_PREFIX = "moving_average/"
_OPTIMIZER_WEIGHTS_PREFIX = "optimizer/_trainable_variables/"
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: str  # the checkpoint's prefix, e.g. /tmp/tower_train/ckpt-30
    flag: str  # how the user named it, for messages: "--checkpoint=..." or "--train_dir=..."
    has_moving_average: bool


_NO_CHECKPOINT_HINT = {True: "; train there first, or name one with --checkpoint",
                       False: " (name a checkpoint prefix such as <train_dir>/ckpt-30, or a run's "
                              "train_dir)"}


def _prefix(checkpoint: str) -> str:
    return checkpoint[:-len(".index")] if checkpoint.endswith(".index") else checkpoint


def check_named_checkpoint(checkpoint: str | None, train_dir: str, model: str | None) -> None:
    """The checks that need no reading of tensors, so that these errors come at once: the path
    named exists, a directory lists checkpoints at all, and the run record beside them (if
    any) names this registered `model` (None: a model given as an object, not yet named)."""
    listed = checkpoint is None or os.path.isdir(checkpoint)  # a directory: its latest checkpoint
    if checkpoint is not None:
        flag, directory = f"--checkpoint={checkpoint}", checkpoint
        if not listed:
            prefix = _prefix(checkpoint)
            if not os.path.isfile(prefix + ".index"):
                raise UsageError(f"{flag}: no such checkpoint ({prefix}.index does not exist); name "
                                 "a checkpoint prefix such as <train_dir>/ckpt-30, or a directory")
            directory = os.path.dirname(prefix) or "."
    else:
        flag, directory = f"--train_dir={train_dir}", train_dir
        if not os.path.isdir(train_dir):
            raise UsageError(f"{flag}: "
                             f"{'is not a directory' if os.path.exists(train_dir) else 'does not exist'}"
                             "; no checkpoint to evaluate (name a run's --train_dir, or --checkpoint)")
    if listed and not checkpoint_numbers(directory):
        raise UsageError(f"{flag}: holds no checkpoint{_NO_CHECKPOINT_HINT[checkpoint is None]}")
    try:
        record = RunRecord.read(directory) or {}
    except UsageError:
        return  # an unreadable record: the restore itself checks the structure
    trained, module = record.get("model"), record.get("model_module")
    if trained is not None and model is not None and trained != model:
        hint = model_label(trained) + (f" --model_module={module}" if module else "")
        raise UsageError(f"{flag}: its checkpoints are of {model_label(trained)} (says "
                         f"{os.path.join(directory, RUN_FILE)}), not {model_label(model)}; pass {hint}")


class CheckpointGone(UsageError):
    """The checkpoint being read was removed meanwhile: a run writing the train_dir rotated it
    away. Evaluating a directory's latest then takes the latest again."""


def _gone(path: str, read_whole: bool) -> bool:
    """Whether the checkpoint `path` was removed: its index is gone, or, once it was read whole,
    any of its files (one without data files from the start is damaged, not removed)."""
    if not os.path.isfile(path + ".index"):
        return True
    return read_whole and not glob.glob(glob.escape(path) + ".data-*")


def _gone_error(info_flag: str, path: str) -> CheckpointGone:
    return CheckpointGone(f"{info_flag}: checkpoint {path} was removed while it was read (by the "
                          "rotation of a run writing there?); name a newer one, or evaluate the "
                          "directory's latest")


def find_checkpoint(checkpoint: str | None, train_dir: str) -> CheckpointInfo:
    """The checkpoint to evaluate, checked readable: --checkpoint (a prefix, or a directory's
    latest), else the latest in train_dir. A directory's latest is its newest whole checkpoint
    (one being saved has no index yet) that is still there once read: a run writing there may
    remove it meanwhile."""
    directory = train_dir if checkpoint is None else checkpoint
    flag = f"--train_dir={train_dir}" if checkpoint is None else f"--checkpoint={checkpoint}"
    if not os.path.isdir(directory):
        return _read_checkpoint(_prefix(checkpoint), flag)
    numbers = checkpoint_numbers(directory)  # from the files: the index may be lost
    if not numbers:
        raise UsageError(f"{flag}: holds no checkpoint{_NO_CHECKPOINT_HINT[checkpoint is None]}")
    for number in numbers:
        path = os.path.join(directory, f"ckpt-{number}")
        if os.path.isfile(path + ".index"):
            try:
                return _read_checkpoint(path, flag)
            except CheckpointGone:
                continue  # the next newest
    raise UsageError(f"{flag}: every checkpoint in it was removed or unfinished while it was read "
                     "(a run writing there?); evaluate again")


def _read_checkpoint(path: str, flag: str) -> CheckpointInfo:
    try:
        reader = tf.train.load_checkpoint(path)
        names = sorted(reader.get_variable_to_shape_map())
        # Read now what a restore may read, so that a damaged file is named here. A variable is
        # stored under the first path that reaches it, which for a Keras model's weights is the
        # optimizer's list of them, not the model's attributes.
        for name in names:
            if name.startswith((_MODEL_PREFIX, _AVERAGE_PREFIX, _OPTIMIZER_WEIGHTS_PREFIX)):
                reader.get_tensor(name)
        roots = _root_objects(reader)
    except READ_ERRORS as e:
        if _gone(path, read_whole=False):
            raise _gone_error(flag, path) from None
        raise UsageError(f"{flag}: checkpoint {path} is unreadable ({first_line(e)})") from None
    if "model" not in roots:
        raise UsageError(f"{flag}: checkpoint {path} holds no 'model' (not written by tower_train?)")
    return CheckpointInfo(path, flag, "moving_average" in roots)


def _root_objects(reader) -> set[str]:
    """The names of the objects a checkpoint's root holds ("model", "optimizer", ...)."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    if not reader.has_tensor(_OBJECT_GRAPH):
        return set()
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH))
    return {child.local_name for child in graph.nodes[0].children}


def restore_for_evaluation(info: CheckpointInfo, objects: dict, model_name: str) -> None:
    """Restores `objects` ({"model": ..., maybe "moving_average": ...}) from the checkpoint;
    the optimizer is not read. UsageError for a checkpoint of another network; CheckpointGone
    for one removed since `find_checkpoint` read it."""
    try:
        shapes = tf.train.load_checkpoint(info.path).get_variable_to_shape_map()
    except READ_ERRORS as e:
        if _gone(info.path, read_whole=True):
            raise _gone_error(info.flag, info.path) from None
        raise UsageError(f"{info.flag}: checkpoint {info.path} is unreadable ({first_line(e)})") from None
    mismatch = shape_mismatch(types.SimpleNamespace(**objects), shapes)
    if mismatch:
        raise UsageError(f"{info.flag}: checkpoint {info.path} does not fit {model_label(model_name)} "
                         f"(a checkpoint of another network?): {mismatch}")
    try:
        tf.train.Checkpoint(**objects).restore(info.path).expect_partial() \
            .assert_existing_objects_matched()
    # A checkpoint of another network fails the match (AssertionError) or a shape (ValueError).
    except READ_ERRORS as e:
        if _gone(info.path, read_whole=True):
            raise _gone_error(info.flag, info.path) from None
        what = ("does not hold the weights of" if isinstance(e, AssertionError)
                else "cannot be restored into")
        raise UsageError(f"{info.flag}: checkpoint {info.path} {what} {model_label(model_name)} "
                         f"({first_line(e)})") from None
