"""Multi-turn episodes, one home for every role (worker, trainer, evaluator, local mode, benchmarks).

- ``driver``: ``EpisodeDriver`` and ``Episode``: what each row sampled, when it pauses at a stop string, runs
  its tools, resumes or ends (engine-agnostic; the engines call it, ``stoa.engines.mlx.rounds`` holds MLX's
  cache handling);
- ``replay``: the trainer's replay of recorded episodes (every observation re-derived with its own tools);
- ``collect``: ``sample_episodes`` with any engine, an episode as a record's sample or a training trajectory,
  the episode figures, the worker's and local mode's rollout calls;
- ``evaluation``: held-out figures of every caller: greedy accuracy, EM/cover-EM, search rate, pass@k;
- ``task_tools``: ``open_task_tools``, a task's tools opened one way (endpoint, index directory, the run's
  index in the bucket, or the task's own corpus).

Nothing here imports torch or mlx.
"""
