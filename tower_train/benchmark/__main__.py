"""`python -m tower_train.benchmark`."""
from tower_train.benchmark import main
from tower_train.cli import run

run(main)
