"""Environments from other RL stacks, run unchanged as tracerl rollouts (OpenEnv; verifiers: ``examples/verifiers_env``)."""
