"""The real run: Ray actors (actors.py), the fleet a plan asks for (fleet.py), episodes to training
batches (batching.py), the orchestrator that runs a plan end to end (orchestrator.py; resume.py checks and
repairs the run folder a resume continues; failures.py words a failed run's error) and the base-policy
pretraining job (pretrain.py). The top room of the runner: it may import every other room.
"""
