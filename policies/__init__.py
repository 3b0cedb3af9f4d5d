"""mixfleet.policies: decisions (router, autoscaler, batcher, weight sync) and the Plan.

Pure Python: no simpy, no torch, no I/O in decisions. The twin and the real runner call the very
same objects. Imports only mixfleet.costmodel.
"""
