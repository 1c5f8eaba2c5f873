"""`python -m tower_train.benchmark`."""
import sys

from tower_train.benchmark import main

sys.exit(main())
