"""python -m tower_train: the training command (`python -m tower_train --help`)."""
from tower_train.cli import run

if __name__ == "__main__":
    run()
