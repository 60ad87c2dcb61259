"""Automatic choices of a run's layout, above the planner and the simulator.

- :mod:`.choose`: the schedule, stages and microbatches on measured link costs (each
  candidate planned, then simulated; ``train --schedule auto``, ``plan --calibration``).
- :mod:`.quick`: the plan of a run given only its number of workers (a quick profile here).
- :mod:`.stage_timing`: stage times measured as a whole, and a profile corrected by them.
"""
