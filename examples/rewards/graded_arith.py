"""A graded reward in verl's form (docs/data.md): examples/mixed_sources_cpu.yaml judges its "differences" rows
with it, and tests/unit/test_reward_contract.py runs this file unchanged.

1.0 for the exact number; otherwise partial credit for a near one, from -1.0 (far off, or no number) up to 0.0;
"acc" is the verdict (accuracy, eval), and the named parts are logged as reward_part/<name>.
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+", solution_str)
    if not numbers:
        return {"score": -1.0, "acc": False, "closeness": 0.0, "has_number": 0.0}
    predicted, truth = int(numbers[-1]), int(ground_truth)
    closeness = max(0.0, 1.0 - abs(predicted - truth) / max(abs(truth), 1))
    exact = predicted == truth
    return {"score": 1.0 if exact else -1.0 + closeness, "acc": exact, "closeness": closeness, "has_number": 1.0}
