"""The inner step: one update of K micro-steps on N towers or replicas, in every mode.

`modes` builds a run's `Mode`, whose inner step (`tower_step.TowerStep`, with its layout from
`spread` under --ps_device=spread; or `strategy_step.StrategyStep`) runs each tower's pass
(`towers`), adds up its sums (`update_sums`) and applies the update once (`update_rule`, with the
rate and average of `schedules`), behind the `inner_step.InnerStep` protocol.
"""
