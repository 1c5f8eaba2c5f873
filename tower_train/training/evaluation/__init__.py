"""Held-out evaluation, shared by training (`--eval_every`, and the last evaluation of a run) and
the eval command (eval.py):

- `held_out.py`: the evaluation pass over the towers (precision @ 1, the held-out loss, Keras
  metrics) and `EvaluationHook`, the Controller's hook that runs it every `--eval_every` updates;
- `checkpoint.py`: the checkpoint an evaluation reads, found, checked against its run record and
  restored into the evaluated model.
"""
