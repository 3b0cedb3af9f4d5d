"""Rollouts: the token-in-token-out agent loop (agent.py), the verifiable tool-use tasks (tasks/), the
scripted demonstrations for pretraining (demos.py) and evaluation (evaluation.py). Drives a sampler
through engine_api; imports the sampler and checkpoint rooms only.
"""
