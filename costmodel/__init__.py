"""mixfleet.costmodel: numbers, in rooms. `specs` (catalog, formats, model / workload specs, mismatch
priors), `steptime` (roofline and measured step times, the published measurements), `plan` (the plan's
plain-data schema), `records` (run logs, ledger, summaries, trackers, output folders) and `calibration` (the
fits of the cost model to run logs); shared utilities at the top (errors, tomlread, limits, paths, jsonsafe).

Pure Python + numpy; imports nothing else of mixfleet.
"""
