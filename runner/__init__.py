"""mixfleet.runner: the real world. Sampler engine and SGLang-protocol server/client, the Megatron-core
trainer, the off-policy corrections, agent loop and tasks, and the asynchronous orchestration on Ray.
Never imports simpy or mixfleet.twin.
"""
