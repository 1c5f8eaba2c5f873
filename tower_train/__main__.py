"""python -m tower_train: data-parallel training with towers and gradient accumulation.

Run commands:
    python -m tower_train --num_gpus=4 --accum=8          # the main job: 4 towers, 8 micro-steps per update
    python -m tower_train --flagfile=flags/main.flags     # the same job as a recipe
    python -m tower_train --helpfull                      # every flag
    python -m pytest -q tests                             # the test suite

Everything runs on the CPU when there is no GPU: the CPU is split into logical
devices, one per tower. See README.md for the semantics of each flag.
"""
from tower_train.cli import run

if __name__ == "__main__":
    run()
