"""An end-to-end GRPO example on dsec: tasks (real bugs in small PyPI packages), rollouts and grading."""
