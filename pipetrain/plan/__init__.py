"""The planner: topology, cost models, the partitioning DP, memory, baselines.

Public API::

    plan(profile, topology, options=PlanOptions()) -> Plan
    evaluate(profile, stages, topology, cost_model="pipedream") -> float
    parse_topology(workers="4,4", bandwidth="300e9,1.25e9", memory=None) -> Topology
    baselines(profile, topology, cost_model=...) -> dict[str, Plan]
"""
from __future__ import annotations

from .api import PlanOptions, plan
from .baselines import balanced_by_parameters, balanced_by_time, baselines, data_parallel_plan, uniform_plan
from .cost import COST_MODELS, CostParams, data_parallel_time, evaluate, evaluate_detail
from .stage_memory import MEMORY_SCHEDULES, stage_memory
from .topology import parse_quantity, parse_topology
from .types import Level, Plan, Stage, Topology

__all__ = [
    "COST_MODELS", "MEMORY_SCHEDULES", "CostParams", "Level", "Plan", "PlanOptions", "Stage", "Topology",
    "balanced_by_parameters", "balanced_by_time", "baselines", "data_parallel_plan", "data_parallel_time",
    "evaluate", "evaluate_detail", "parse_quantity", "parse_topology", "plan", "stage_memory", "uniform_plan",
]
