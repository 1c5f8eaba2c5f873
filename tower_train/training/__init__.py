"""The outer loop around the inner step: a run's state (`run`), the `controller.Controller` and
its hooks (`hooks`, `progress`, `held_out` evaluations, the user's `keras_callbacks`), the
train_dir's files (`run_record` and its lock, `checkpoints`, `evaluation.checkpoint`), and stops
(`stop_signals`, `stop_deadline`).
"""
