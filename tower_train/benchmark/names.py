"""The benchmark's configurations: what a name such as tower_pscpu_k8_b32_data says, the suite
each measure runs by default, and the pairs its report compares."""
from __future__ import annotations

import dataclasses
import re

from tower_train.rules import PLACEMENTS
from tower_train.errors import UsageError

TOWER_KIND = "tower_ps"  # + a --ps_device: tower mode on that placement
# Tower mode on each placement (`rules.PLACEMENTS`), by its --ps_device.
TOWER_KINDS = {f"{TOWER_KIND}{name}": f"tower mode, {rules.what}" for name, rules in PLACEMENTS.items()}
# The placements whose towers may read the weights at every micro-step (_permicro).
PER_MICRO_STEP_KINDS = tuple(f"{TOWER_KIND}{name}" for name, rules in PLACEMENTS.items()
                             if not rules.copies_per_update_only)
KINDS = {
    "plain": "one GradientTape step over all G examples on the parameter device: the reference",
    **TOWER_KINDS,
    "mirrored": "MirroredStrategy over the same towers",
    "central_storage": "CentralStorageStrategy over the same towers and parameter device",
    "keras_fit": "Keras 3 model.fit on one device, optimizer.gradient_accumulation_steps = K",
}
MEASURES = ("time", "memory", "traffic", "ops", "keras")
_NAME = re.compile(r"^(?P<kind>[a-z_]+?)_k(?P<accum>\d+)(?:_b(?P<batch>\d+))?(?:_s(?P<split>\d+(?:-\d+)+))?"
                   r"(?P<permicro>_permicro)?(?:_(?P<input>data|tfrecord|dataset))?$")
NAME_FORM = "KIND_kK[_bB][_sA-B...][_permicro][_data|_tfrecord|_dataset]"
MODE_KINDS = (*TOWER_KINDS, "mirrored", "central_storage")  # run by a mode's inner step
# One fixed batch; the source's pipeline; streamed files; a tf.data pipeline of the same arrays.
INPUTS = ("memory", "data", "tfrecord", "dataset")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One parsed configuration name."""

    name: str
    kind: str
    accum: int  # K
    batch_size: int  # B, per tower per micro-step
    input: str  # one of INPUTS
    tower_split: str | None = None  # --tower_split, e.g. "1,3" (tower kinds only)
    weights_per_micro_step: bool = False  # _permicro: --tower_weights=per_micro_step (tower kinds only)


def parse_config_name(name: str, default_batch_size: int) -> BenchConfig:
    """'tower_pscpu_k8_b32_data' -> BenchConfig(kind='tower_pscpu', accum=8, batch_size=32, input='data')."""
    match = _NAME.match(name)
    if not match or match["kind"] not in KINDS or int(match["accum"]) < 1 or (
            match["batch"] is not None and int(match["batch"]) < 1):
        raise UsageError(f"--configs: {name!r} is not {NAME_FORM} with KIND in "
                         f"{', '.join(KINDS)}, K >= 1 and B >= 1")
    batch = default_batch_size if match["batch"] is None else int(match["batch"])
    split = match["split"] and match["split"].replace("-", ",")
    if split and match["kind"] not in TOWER_KINDS:
        raise UsageError(f"--configs: {name!r}: _sSHARES (--tower_split) is for the tower kinds only")
    if match["permicro"] and match["kind"] not in PER_MICRO_STEP_KINDS:
        raise UsageError(f"--configs: {name!r}: _permicro (--tower_weights=per_micro_step) is for "
                         f"{' and '.join(PER_MICRO_STEP_KINDS)} only")
    return BenchConfig(name, match["kind"], int(match["accum"]), batch, match["input"] or "memory", split,
                       bool(match["permicro"]))


def default_configs(measure: str, batch_size: int) -> list[str]:
    """The suite for `--measure` when --configs is not given.

    time: every kind at K = 1 and K = 8 with the same micro-batch; tower mode at K = 1
    with the G of K = 8 (a micro-batch 8 times larger); tower mode at K = 8 with the weights
    read at every micro-step; tower mode at K = 8 fed by the input pipeline. memory: tower mode
    at one G = 8 x batch_size x towers, as K = 1, 2, 4, 8. traffic: every kind that crosses
    devices at K = 1 and K = 8, and tower mode at K = 8 with the weights read at every
    micro-step.
    """
    if measure == "memory":
        return [f"tower_pscpu_k{k}_b{batch_size * 8 // k}" for k in (1, 2, 4, 8)]
    if measure == "traffic":
        return [f"{kind}_k{k}" for kind in MODE_KINDS for k in (1, 8)] + ["tower_pscpu_k8_permicro"]
    return ([f"{kind}_k{k}" for kind in KINDS for k in (1, 8)]
            + [f"tower_pscpu_k1_b{batch_size * 8}", "tower_pscpu_k8_permicro", "tower_pscpu_k8_data",
               "tower_pscpu_k8_tfrecord"])


def comparisons(names: list[str], batch_size: int) -> list[tuple[str, str, str]]:
    """(A, B, what it shows) for every pair of the suite whose two configurations were run;
    the report prints time per example of A / B."""
    pairs = []
    for k in (1, 8):
        pairs += [(f"tower_pscpu_k{k}", f"plain_k{k}", "towers vs one device, same G; goal <= 1.05"),
                  (f"tower_psgpu_k{k}", f"plain_k{k}", "towers vs one device, same G"),
                  (f"tower_psspread_k{k}", f"tower_pscpu_k{k}", "variables spread over the towers vs on the host"),
                  (f"tower_pscpu_k{k}", f"mirrored_k{k}", "goal <= 1.0"),
                  (f"tower_pscpu_k{k}", f"central_storage_k{k}", ""),
                  (f"tower_pscpu_k{k}", f"keras_fit_k{k}", "goal <= 1.0")]
    pairs += [("tower_pscpu_k8", "tower_pscpu_k1", "same micro-batch; goal <= 1.0"),
              ("tower_pscpu_k8", "tower_pscpu_k8_permicro", "weights once per update vs every micro-step"),
              ("tower_pscpu_k8", f"tower_pscpu_k1_b{batch_size * 8}", "same G, micro-batch 8x smaller"),
              ("tower_pscpu_k8_data", "tower_pscpu_k8", "input pipeline vs in memory; goal <= 1.03"),
              ("tower_pscpu_k8_tfrecord", "tower_pscpu_k8", "streamed TFRecord files vs in memory; goal <= 1.03"),
              ("tower_pscpu_k8_dataset", "tower_pscpu_k8", "a tf.data pipeline vs in memory; goal <= 1.03")]
    present = set(names)
    return [pair for pair in pairs if pair[0] in present and pair[1] in present]


def floor_config(bench: BenchConfig) -> str:
    """The same configuration at one example per tower: what its updates add to the process
    besides activations (thread pools, weight copies, gradients and their sums, the update)."""
    return (f"{bench.kind}_k{bench.accum}_b1" + ("_permicro" if bench.weights_per_micro_step else "")
            + ("" if bench.input == "memory" else f"_{bench.input}"))
