from vf_calc.taskset import VfCalcTaskset

__all__ = ["VfCalcTaskset"]
