"""Put back, in every process of a rehearsal, a cause of the paper-scale issue that the rehearsal must name
(tests/dist/test_rehearsal.py): on PYTHONPATH, Python imports this at start-up.

DAPO_TEST_FAULT=every_sample_to_every_rank_from_step_2: from the second step on, the step's exchange sends every
chosen sample to every rank, as the sampler did before the paper-scale fix (each rank then held every token of
the step, not its own share); the first step runs as the code is. One rehearsal shows both.

The sampler is changed as it is imported, in the processes that import it (the ranks), not here: importing it
here imported torch (about 4 CPU-s) into every Python process of the rehearsal, each rank's verifier worker,
multiprocessing's resource tracker and the checkpoint writer's manager included."""

import os
import sys

FAULT = "every_sample_to_every_rank_from_step_2"
SAMPLER = "dapo_mcore.rollout.sampler"


def _every_sample_to_every_rank_from_step_2(sampler_module) -> None:
    from dapo_mcore.rollout.exchange import EVERY_RANK

    RolloutSampler = sampler_module.RolloutSampler
    trainers_of_the_code = RolloutSampler._trainers
    steps_seen = []

    def _every_rank_from_step_2(self, chosen):
        steps_seen.append(1)  # one exchange of the step's batch a step
        if len(steps_seen) == 1:
            return trainers_of_the_code(self, chosen)
        return [[EVERY_RANK] * len(group.samples) for group in chosen]

    RolloutSampler._trainers = _every_rank_from_step_2


class _ChangeTheSamplerOnImport:
    """A finder for the sampler's module alone: it finds it as the path finder does, and changes it once it ran."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != SAMPLER:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run_the_module = spec.loader.exec_module

        def exec_module(module):
            run_the_module(module)
            _every_sample_to_every_rank_from_step_2(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("DAPO_TEST_FAULT") == FAULT:
    sys.meta_path.insert(0, _ChangeTheSamplerOnImport)
