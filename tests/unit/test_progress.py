"""The console's step counter: step N = N updates done, as in metrics.jsonl, the saves and the stop messages."""

from dapo_mcore.utils.progress import RunProgress, summary_line


def test_the_summary_line_names_the_step_the_update_completes():
    assert summary_line(3, 60, {"rollout/accuracy": 0.5}).startswith("step 3/60 | acc 0.500")


def test_the_bar_of_a_finished_run_says_every_step_is_done_not_a_step_past_the_end():
    """It read `DAPO step 61` after a 60-step run."""
    progress = RunProgress(enabled=True, total_steps=2)
    with progress:
        progress.resume_at(1)
        assert progress._progress.tasks[0].description == "step 2: generating"
        progress.step_done(2, {})
        task = progress._progress.tasks[0]
        assert (task.completed, task.description) == (2, "2 steps done")
