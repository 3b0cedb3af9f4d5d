"""mixfleet.costmodel.records.

Run records: the run log both worlds write (`runlog`), the one update / group ledger (`ledger`), a run
log's summary with steady-state analysis (`runsummary`), its metrics for TensorBoard / W&B (`trackers`)
and the one output-folder rule (`outdir`).
"""
