"""The run directory on disk: checkpoints, history and trajectories, written to survive SIGKILL.

``storage`` lays the directory out, ``durable`` holds the crash-safe file primitives,
``run_lock`` keeps one trainer per model, ``plots`` draws the history.
"""
