"""Put back, in every process of a rehearsal, a cause of the paper-scale issue that the rehearsal must name
(tests/dist/test_rehearsal.py): on PYTHONPATH, Python imports this at start-up.

DAPO_TEST_FAULT=every_sample_to_every_rank_from_step_2: from the second step on, the step's exchange sends every
chosen sample to every rank, as the sampler did before the paper-scale fix (each rank then held every token of
the step, not its own share); the first step runs as the code is. One rehearsal shows both."""

import os

if os.environ.get("DAPO_TEST_FAULT") == "every_sample_to_every_rank_from_step_2":
    from dapo_mcore.rollout.exchange import EVERY_RANK
    from dapo_mcore.rollout.sampler import RolloutSampler

    trainers_of_the_code = RolloutSampler._trainers
    steps_seen = []

    def _every_rank_from_step_2(self, chosen):
        steps_seen.append(1)  # one exchange of the step's batch a step
        if len(steps_seen) == 1:
            return trainers_of_the_code(self, chosen)
        return [[EVERY_RANK] * len(group.samples) for group in chosen]

    RolloutSampler._trainers = _every_rank_from_step_2
