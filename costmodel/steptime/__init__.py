"""mixfleet.costmodel.steptime.

Step-time models of a sampler replica, the trainer and weight sync: the roofline with efficiency
factors (`roofline`), the measured backend from aiconfigurator's databases (`measured`), the published
serving measurements they are held against and the fit of the roofline's factors to them
(`measurements`, `measurement_fit`), and the catalog and capacity reports (`report`).
"""
