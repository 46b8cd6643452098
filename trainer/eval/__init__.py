"""Evaluation: in-loop val loss, a checkpoint's full evaluation, lm-eval downstream tasks, their stages."""
